"""A Ray cluster shared by the transfer tests, and the test worker as an actor class."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    # Actor processes must import tests.transfer.peers: they inherit this environment.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), old) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    yield
    ray.shutdown()
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


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
