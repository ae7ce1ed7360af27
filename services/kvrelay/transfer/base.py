"""The KV connector contract (docs/architecture.md section 3): how a decode worker pulls a prefill
worker's KV blocks. Implementations: NIXL (UCX) and gRPC; both move raw block bytes only.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol, TypeVar

import torch

from kvrelay.common.messages import KVHandle, PeerMetadata, PullPlan
from kvrelay.transfer.kv_secret import ClaimPull


class TransferError(RuntimeError):
    """A pull failed; the decode engine falls back to recomputing the prompt."""


class StalePeerError(TransferError):
    """The handle names an engine epoch this connector does not know (the peer restarted)."""


class _Peer(Protocol):
    """What a connector keeps of a peer, as far as the epoch rules go."""

    @property
    def epoch(self) -> int: ...


PeerT = TypeVar("PeerT", bound=_Peer)


def known_peer(peers: Mapping[str, PeerT], lock: threading.Lock, handle: KVHandle) -> PeerT:
    """The peer `handle` comes from, from a connector's `peers` by engine id (read under
    `lock`), refused unless the connector knows that engine at the handle's epoch: the one
    peer-epoch check both connectors make before a pull.

    Raises:
        StalePeerError: the engine is unknown here, or known at another epoch.
    """
    with lock:
        peer = peers.get(handle.engine_id)
    if peer is None or peer.epoch != handle.epoch:
        known = "unknown" if peer is None else f"at epoch {peer.epoch}"
        raise StalePeerError(
            f"handle of {handle.engine_id} epoch {handle.epoch}: that engine is {known} "
            "here (it restarted, or add_peer was not called); recompute the prompt"
        )
    return peer


def is_older_life(peers: Mapping[str, PeerT], lock: threading.Lock, meta: PeerMetadata) -> bool:
    """Whether `meta` tells of an older life of an engine the connector knows at a newer
    epoch (a late message, which `add_peer` ignores)."""
    with lock:
        known = peers.get(meta.engine_id)
    return known is not None and known.epoch > meta.epoch


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
