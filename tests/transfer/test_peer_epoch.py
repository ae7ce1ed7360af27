"""The peer-epoch rules both KV connectors share (transfer/base.py): a pull needs the peer at
the handle's epoch; metadata of an older life than the one known is ignored."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from kvrelay.common.messages import KVHandle, PeerMetadata
from kvrelay.transfer.base import StalePeerError, is_older_life, known_peer


@dataclass(frozen=True)
class Peer:
    epoch: int


def handle(engine_id: str, epoch: int) -> KVHandle:
    return KVHandle(engine_id, epoch, "r", (0,), 1, (), 0)


def test_a_pull_needs_the_peer_at_the_handles_epoch() -> None:
    peers, lock = {"P": Peer(2)}, threading.Lock()
    assert known_peer(peers, lock, handle("P", 2)) is peers["P"]
    with pytest.raises(StalePeerError, match="P epoch 1: that engine is at epoch 2"):
        known_peer(peers, lock, handle("P", 1))
    with pytest.raises(StalePeerError, match="Q epoch 2: that engine is unknown"):
        known_peer(peers, lock, handle("Q", 2))


def test_metadata_of_an_older_life_is_the_only_one_ignored() -> None:
    peers, lock = {"P": Peer(2)}, threading.Lock()
    meta = [PeerMetadata(e, epoch, "grpc", b"h:1") for e, epoch in (("P", 1), ("P", 2), ("P", 3))]
    assert [is_older_life(peers, lock, m) for m in meta] == [True, False, False]
    assert not is_older_life(peers, lock, PeerMetadata("Q", 1, "grpc", b"h:1"))
