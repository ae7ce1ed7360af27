"""Handles, leases and plans for transfer tests, and the expected decode tensor after a pull."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import torch

from kvrelay.common.messages import KVHandle, PullPlan
from kvrelay.engine.leases import LeaseTable
from kvrelay.transfer.kv_secret import KVSecret

SECRET = KVSecret(b"kvrelay-tests-deployment-secret!")  # the tests' deployment secret

# (remote ids, local ids): consecutive (one run), scattered, mixed, into non-identity ids.
PLANS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "consecutive": ((2, 3, 4, 5), (9, 10, 11, 12)),
    "scattered": ((15, 0, 7, 3), (1, 14, 2, 6)),
    "mixed": ((4, 5, 6, 11, 12, 1), (0, 1, 2, 8, 9, 15)),
}


def handle_for(engine_id: str, epoch: int, remote: Sequence[int], handle_id: str = "") -> KVHandle:
    return KVHandle(
        engine_id=engine_id,
        epoch=epoch,
        request_id="req",
        block_ids=tuple(remote),
        num_tokens=4 * len(remote),
        block_hashes=(),
        first_token_id=0,
        handle_id=handle_id,
    )


def plan_for(remote: Sequence[int], local: Sequence[int]) -> PullPlan:
    return PullPlan("req", tuple(remote), tuple(local))


class Leases:
    """A prefill side's lease table, as an engine's hand-off keeps it: every `handle` is a
    fresh lease on `remote`, bound to `decode` when given. Serve with `authorize_pulls(claim)`."""

    def __init__(self) -> None:
        self.table = LeaseTable()

    def handle(
        self,
        engine_id: str,
        epoch: int,
        remote: Sequence[int],
        decode: str | None = None,
        ttl_s: float = 60.0,
    ) -> KVHandle:
        handle_id = secrets.token_urlsafe(24)
        self.table.grant(handle_id, time.monotonic() + ttl_s, handle_id, remote)
        if decode is not None:
            assert self.table.bind(handle_id, decode)
        return handle_for(engine_id, epoch, remote, handle_id)

    def claim(self, handle_id: str, requester: str, block_ids: Sequence[int]) -> bool:
        return self.table.claim(handle_id, requester, block_ids, time.monotonic()) is None


def after_pull(
    before: torch.Tensor, source: torch.Tensor, remote: Sequence[int], local: Sequence[int]
) -> torch.Tensor:
    """What the puller's whole tensor must equal: the plan's blocks copied, nothing else."""
    expected = before.clone()
    expected[list(local)] = source[list(remote)]
    return expected
