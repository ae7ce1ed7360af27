"""The KV connector contract (docs/architecture.md section 3): how a decode worker pulls a prefill
worker's KV blocks. Implementations: NIXL (UCX) and gRPC; both move raw block bytes only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvrelay.messages import KVHandle, PeerMetadata, PullPlan
from kvrelay.transfer.auth import ClaimPull


class TransferError(RuntimeError):
    """A pull failed; the decode engine falls back to recomputing the prompt."""


class StalePeerError(TransferError):
    """The handle names an engine epoch this connector does not know (the peer restarted)."""


def check_peer_epoch(handle: KVHandle, known_epoch: int | None) -> None:
    """Refuse a handle unless it comes from the life of its engine this connector knows.

    Raises:
        StalePeerError: the engine is unknown here, or known at another epoch.
    """
    if known_epoch is None or known_epoch != handle.epoch:
        known = "unknown" if known_epoch is None else f"at epoch {known_epoch}"
        raise StalePeerError(
            f"handle of {handle.engine_id} epoch {handle.epoch}: that engine is {known} "
            "here (it restarted, or add_peer was not called); recompute the prompt"
        )


class KVConnector(ABC):
    """One per worker. A prefill worker registers its KV tensor and publishes `metadata()`;
    a decode worker registers its own, learns peers with `add_peer`, and `pull`s."""

    @abstractmethod
    def register(self, kv_tensor: torch.Tensor, engine_id: str, epoch: int) -> None:
        """Make this worker's block-major KV tensor reachable (once, at start)."""

    @abstractmethod
    def metadata(self) -> PeerMetadata:
        """What peers need to pull from this worker (after `register`)."""

    @abstractmethod
    def add_peer(self, peer: PeerMetadata) -> None:
        """Learn (or re-learn, after a restart: a newer epoch replaces the old) a peer."""

    @abstractmethod
    def pull(self, handle: KVHandle, plan: PullPlan) -> None:
        """Copy the peer's `plan.remote_block_ids` into this worker's `plan.local_block_ids`.

        Blocking; returns when every byte has landed.

        Raises:
            StalePeerError: `handle.engine_id` / `handle.epoch` is not a known peer's.
            TransferError: the transfer failed or timed out.
        """

    def authorize_pulls(self, claim: ClaimPull) -> None:  # noqa: B027 - optional hook
        """Serve only the pulls `claim` allows. A transport that sees each pull (gRPC) asks
        it; a one-sided one (NIXL READ) cannot, and relies on its peer metadata reaching the
        platform's workers only (through Ray), never a listener."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources."""
