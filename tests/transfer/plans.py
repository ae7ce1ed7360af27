"""Handles and plans for transfer tests, and the expected decode tensor after a pull."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.messages import KVHandle, PullPlan

# (remote ids, local ids): consecutive (one run), scattered, mixed, into non-identity ids.
PLANS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "consecutive": ((2, 3, 4, 5), (9, 10, 11, 12)),
    "scattered": ((15, 0, 7, 3), (1, 14, 2, 6)),
    "mixed": ((4, 5, 6, 11, 12, 1), (0, 1, 2, 8, 9, 15)),
}


def handle_for(engine_id: str, epoch: int, remote: Sequence[int]) -> KVHandle:
    return KVHandle(
        engine_id=engine_id,
        epoch=epoch,
        request_id="req",
        block_ids=tuple(remote),
        num_tokens=4 * len(remote),
        block_hashes=(),
        first_token_id=0,
    )


def plan_for(remote: Sequence[int], local: Sequence[int]) -> PullPlan:
    return PullPlan("req", tuple(remote), tuple(local))


def after_pull(
    before: torch.Tensor, source: torch.Tensor, remote: Sequence[int], local: Sequence[int]
) -> torch.Tensor:
    """What the puller's whole tensor must equal: the plan's blocks copied, nothing else."""
    expected = before.clone()
    expected[list(local)] = source[list(remote)]
    return expected
