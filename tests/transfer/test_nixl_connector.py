"""Real NIXL (UCX) transfers between two Ray actor processes: exact bytes, stale epochs,
failures within a bounded time. No mocks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kvrelay.common.messages import PeerMetadata
from kvrelay.transfer.base import StalePeerError, TransferError
from kvrelay.transfer.factory import nixl_available
from kvrelay.transfer.nixl_connector import NixlConnector
from tests.transfer.peers import make_kv
from tests.transfer.plans import PLANS, after_pull, handle_for, plan_for

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pair(actor_pair: tuple[Any, Any]) -> tuple[Any, Any]:
    """Prefill "P" (epoch 1, random blocks) and decode "D" (zeros) that knows P."""
    prefill, decode = actor_pair
    meta = ray.get(prefill.start.remote("nixl", "P", 1, 0))
    ray.get(decode.start.remote("nixl", "D", 1, None, 2.0))
    ray.get(decode.add_peer.remote(meta))
    return prefill, decode


@pytest.mark.parametrize("name", sorted(PLANS))
def test_pulled_blocks_equal_the_source_and_nothing_else_changes(
    name: str, pair: tuple[Any, Any]
) -> None:
    prefill, decode = pair
    remote, local = PLANS[name]
    source = ray.get(prefill.kv_tensor.remote())
    before = ray.get(decode.kv_tensor.remote())
    status = ray.get(decode.pull.remote(handle_for("P", 1, remote), plan_for(remote, local)))
    assert status[:2] == ("ok", "")
    expected = after_pull(before, source, remote, local)
    assert torch.equal(ray.get(decode.kv_tensor.remote()), expected)
    assert torch.equal(ray.get(prefill.kv_tensor.remote()), source)  # a READ leaves it alone


def test_unknown_peers_are_stale(pair: tuple[Any, Any]) -> None:
    _, decode = pair
    for engine_id in ("nobody", "D"):  # never added; itself
        status = ray.get(decode.pull.remote(handle_for(engine_id, 1, [0]), plan_for([0], [0])))
        assert status[0] == "StalePeerError"


def test_restart_makes_old_handles_stale_then_death_fails_fast(
    pair: tuple[Any, Any], peer_actor: Any
) -> None:
    _, decode = pair
    peer = peer_actor.remote()
    ray.get(decode.add_peer.remote(ray.get(peer.start.remote("nixl", "K", 1, 3))))
    assert ray.get(decode.pull.remote(handle_for("K", 1, [0]), plan_for([0], [0])))[0] == "ok"

    # K restarts: epoch 2, other bytes. Its epoch-1 handles are refused, epoch-2 ones read.
    reborn = ray.get(peer.start.remote("nixl", "K", 2, 7))
    ray.get(decode.add_peer.remote(reborn))
    old = ray.get(decode.pull.remote(handle_for("K", 1, [1]), plan_for([1], [3])))
    assert old[0] == "StalePeerError"
    before = ray.get(decode.kv_tensor.remote())
    new = ray.get(decode.pull.remote(handle_for("K", 2, [1, 2]), plan_for([1, 2], [3, 4])))
    assert new[0] == "ok"
    expected = after_pull(before, make_kv(7), [1, 2], [3, 4])
    assert torch.equal(ray.get(decode.kv_tensor.remote()), expected)

    # K dies: a pull fails within the decode side's 2 s timeout.
    ray.kill(peer)
    time.sleep(0.5)  # let the process go
    status, message, seconds = ray.get(
        decode.pull.remote(handle_for("K", 2, [1, 2]), plan_for([1, 2], [5, 6]))
    )
    assert status == "TransferError", message
    assert seconds < 2.5


def test_in_process_pull_and_refusals() -> None:
    source, target = NixlConnector(timeout_s=1.0), NixlConnector(timeout_s=1.0)
    src, dst = make_kv(5), make_kv(None)
    source.register(src, "S", 3)
    target.register(dst, "T", 1)
    try:
        target.add_peer(source.metadata())
        target.add_peer(source.metadata())  # introduced twice (pools, then a router): still one
        target.add_peer(PeerMetadata("S", 2, "nixl", b"ignored: an older epoch"))
        remote, local = PLANS["mixed"]
        before = dst.clone()
        target.pull(handle_for("S", 3, remote), plan_for(remote, local))
        assert torch.equal(dst, after_pull(before, src, remote, local))
        with pytest.raises(TransferError, match=r"remote block ids \[16\] are outside"):
            target.pull(handle_for("S", 3, [16]), plan_for([16], [0]))
        with pytest.raises(TransferError, match=r"local block ids \[99\] are outside"):
            target.pull(handle_for("S", 3, [1]), plan_for([1], [99]))
        with pytest.raises(StalePeerError):
            target.pull(handle_for("S", 2, [1]), plan_for([1], [0]))
        assert torch.equal(dst, after_pull(before, src, remote, local))
    finally:
        target.close()
        source.close()


def test_add_peer_refuses_bad_metadata() -> None:
    connector = NixlConnector(timeout_s=1.0)
    connector.register(make_kv(None), "X", 1)
    other = NixlConnector()
    other.register(torch.zeros(4, 1, 2, 4, 2, 8), "Z", 1)  # half the block size
    try:
        with pytest.raises(ValueError, match="'grpc' peer"):
            connector.add_peer(PeerMetadata("Y", 1, "grpc", b"127.0.0.1:1"))
        with pytest.raises(ValueError, match="unreadable"):
            connector.add_peer(PeerMetadata("Y", 1, "nixl", b"\xff\xff garbage"))
        with pytest.raises(ValueError, match="same model, dtype and block size"):
            connector.add_peer(other.metadata())
    finally:
        other.close()
        connector.close()


def test_register_refuses_a_non_block_major_tensor() -> None:
    with pytest.raises(ValueError, match="block-major"):
        NixlConnector().register(torch.zeros(4, 8), "X", 1)


def test_concurrent_pulls_from_other_threads() -> None:
    """Pulls on threads that did not create the agent, several at once, land exactly."""
    source, target = NixlConnector(timeout_s=2.0), NixlConnector(timeout_s=2.0)
    src, dst = make_kv(9), make_kv(None)
    source.register(src, "S", 1)
    target.register(dst, "T", 1)
    try:
        target.add_peer(source.metadata())
        pairs = [([i], [15 - i]) for i in range(8)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda p: target.pull(handle_for("S", 1, p[0]), plan_for(*p)), pairs))
        assert torch.equal(dst[8:].flip(0), src[:8])
        assert not dst[:8].any()
    finally:
        target.close()
        source.close()


def test_an_idle_agent_leaves_the_cpu_alone() -> None:
    # NIXL's wrapper makes the UCX progress thread busy-spin; on a 2-core machine that took a
    # core from the engines. The connector gives it a sleep when idle.
    connector = NixlConnector()
    connector.register(make_kv(seed=1), "idle", 1)
    start = time.process_time()
    time.sleep(1.0)
    used = time.process_time() - start
    connector.close()
    assert used < 0.3, f"an idle NIXL agent used {used:.2f} CPU seconds in 1 s"
