"""A test worker holding one KV tensor and one connector; the tests run it as a Ray actor."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from kvrelay.common.messages import KVHandle, PeerMetadata, PullPlan
from kvrelay.transfer.base import KVConnector, TransferError
from kvrelay.transfer.factory import create_connector
from kvrelay.transfer.kv_secret import KVSecret
from tests.transfer.plans import SECRET, Leases

# A tiny model's block: [layers=2, K/V, block 4, heads 2, dim 8] fp32 = 512 bytes.
TINY_BLOCK = (2, 2, 4, 2, 8)
NUM_BLOCKS = 16


def make_kv(seed: int | None, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """Random blocks from `seed`, or zeros for `None`."""
    if seed is None:
        return torch.zeros((num_blocks, *TINY_BLOCK))
    return torch.randn((num_blocks, *TINY_BLOCK), generator=torch.Generator().manual_seed(seed))


class KVPeer:
    """One worker's side of the relay: its KV tensor, its connector, its leases. `start` again
    to model a restart (a new life: new tensor, new connector) without paying for a process."""

    def __init__(self) -> None:
        self.kv = make_kv(None)
        self.connector: KVConnector | None = None
        self.leases = Leases()
        self.engine_id = ""
        self.epoch = 0

    def start(
        self,
        backend: str,
        engine_id: str,
        epoch: int,
        seed: int | None,
        timeout_s: float = 5.0,
        secret: KVSecret | None = SECRET,
    ) -> PeerMetadata:
        if self.connector is not None:
            self.connector.close()
        self.kv = make_kv(seed)
        self.connector = create_connector(backend, secret=secret, timeout_s=timeout_s)
        self.connector.register(self.kv, engine_id, epoch)
        self.leases = Leases()
        self.connector.authorize_pulls(self.leases.claim)
        self.engine_id, self.epoch = engine_id, epoch
        return self.connector.metadata()

    def lease(self, remote: Sequence[int], decode: str | None = None) -> KVHandle:
        """A handle of this peer's current life on `remote`, pullable once (by `decode`)."""
        return self.leases.handle(self.engine_id, self.epoch, remote, decode)

    def metadata(self) -> PeerMetadata:
        return self._connector().metadata()

    def add_peer(self, peer: PeerMetadata) -> None:
        self._connector().add_peer(peer)

    def pull(self, handle: KVHandle, plan: PullPlan) -> tuple[str, str, float]:
        """("ok" | the error's class name, its message, seconds taken)."""
        start = time.perf_counter()
        try:
            self._connector().pull(handle, plan)
        except TransferError as exc:
            return type(exc).__name__, str(exc), time.perf_counter() - start
        return "ok", "", time.perf_counter() - start

    def kv_tensor(self) -> torch.Tensor:
        return self.kv.clone()

    def pid(self) -> int:
        return os.getpid()

    def _connector(self) -> KVConnector:
        assert self.connector is not None, "call start() first"
        return self.connector
