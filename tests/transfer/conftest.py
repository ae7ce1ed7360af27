"""A Ray cluster shared by the transfer tests, and the test worker as an actor class."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster(ray_session: None) -> None:
    """The session's Ray cluster (tests/conftest.py)."""


@pytest.fixture(scope="session")
def peer_actor(ray_cluster: None) -> Any:
    """`KVPeer` as a Ray actor class: `peer_actor.remote(backend, engine_id, epoch, seed)`."""
    import ray

    from tests.transfer.peers import KVPeer

    return ray.remote(num_cpus=0)(KVPeer)


@pytest.fixture(scope="session")
def actor_pair(peer_actor: Any) -> tuple[Any, Any]:
    """Two worker processes, (prefill, decode), reused by every cross-process test: each test
    `start`s the connectors it needs (a process costs seconds here, a connector milliseconds)."""
    return peer_actor.remote(), peer_actor.remote()
