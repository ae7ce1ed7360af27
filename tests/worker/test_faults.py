"""Faults between prefill and decode, injected through real Ray workers over NIXL: a lease that
expires (its blocks reused) before the pull, and a prefill worker killed before the pull.
Requests still end correctly (recomputed) or, with kv_transfer_failure="fail", clearly failed;
the surviving workers' pools are whole and hold no lease."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from kvrelay.common.messages import EngineRequest, EngineStats
from kvrelay.config import RouterConfig
from kvrelay.router.local import complete, local_router
from kvrelay.worker.pools import Pools
from tests.engine.conftest import EngineFactory
from tests.worker.conftest import TINY_ENGINE_KWARGS
from tests.worker.test_pools import colocated, greedy, streamed_tokens

PROMPT = list(range(3, 23))  # five full blocks of 4
OTHER = list(range(60, 80))  # as long: its prefill reuses the blocks of PROMPT's expired lease
LEASE_S = 0.5


def start(tiny_llama_dir: Path, **engine_kwargs: Any) -> Pools:
    return Pools.start(
        str(tiny_llama_dir),
        transfer_backend="nixl",
        engine_kwargs={**TINY_ENGINE_KWARGS, **engine_kwargs},
    )


@pytest.fixture
def short_lease(worker_ray: None, tiny_llama_dir: Path) -> Iterator[Pools]:
    # Eight blocks: a second 5-block prefill must take blocks of the first one.
    pools = start(tiny_llama_dir, kv_lease_seconds=LEASE_S, num_blocks=8)
    yield pools
    pools.shutdown()


def stats(worker: Any) -> EngineStats:
    result: EngineStats = ray.get(worker.stats.remote())
    return result


def assert_whole(workers: list[Any]) -> None:
    for s in ray.get([worker.stats.remote() for worker in workers]):
        assert s.num_free_blocks == s.num_blocks
        assert s.num_leases == 0 and s.num_pulling == 0
        assert s.num_running == 0 and s.num_waiting == 0


def wait_for_expiry(worker: Any, expired: int) -> None:
    deadline = time.monotonic() + 10
    while stats(worker).kv_leases_expired < expired:
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.05)


def test_lease_expired_and_blocks_reused_before_the_pull(
    short_lease: Pools, make_engine: EngineFactory
) -> None:
    pools = short_lease
    prefill, decode = pools.prefill_workers[0], pools.decode_workers[0]
    first = ray.get(prefill.prefill.remote(EngineRequest("x", PROMPT, greedy(6))))
    assert first.kv_handle is not None
    wait_for_expiry(prefill, 1)
    # Another prompt's prefill now overwrites blocks the expired handle still names.
    other = ray.get(prefill.prefill.remote(EngineRequest("y", OTHER, greedy(6))))
    assert other.kv_handle is not None
    assert set(other.kv_handle.block_ids) & set(first.kv_handle.block_ids)
    assert ray.get(prefill.release_kv.remote("y"))
    # Trusting the handle decodes from the other prompt's KV: the output would differ.
    stale, _ = streamed_tokens(decode, EngineRequest("stale", PROMPT, greedy(6), first.kv_handle))
    expected = colocated(make_engine, {"x": PROMPT}, 6)["x"]
    if stats(decode).kv_pull_fallbacks == 0:  # the pull went through: it read OTHER's KV
        assert stale != expected
    assert ray.get(decode.forget_kv.remote(first.kv_handle)) > 0  # what the stale pull cached

    # Through the router's relay the lost lease is noticed and the prompt recomputed.
    async def expiring() -> tuple[list[int], float]:
        router = await local_router(pools.workers, config=RouterConfig(max_local_prefill_tokens=0))
        orig = prefill.release_kv

        class Late:  # the lease expires (and its blocks are reused) before the pull ends
            @staticmethod
            def remote(rid: str) -> Any:
                wait_for_expiry(prefill, 2)
                ray.get(prefill.prefill.remote(EngineRequest("z", OTHER, greedy(6))))
                ray.get(orig.remote("z"))
                return orig.remote(rid)

        prefill.release_kv = Late  # the registry holds this very handle object
        try:
            out = await complete(router, PROMPT, greedy(6), request_id="x2")
        finally:
            prefill.release_kv = orig
        return out.choices[0].token_ids, router.metrics.leases_lost._value.get()

    tokens, leases_lost = asyncio.run(expiring())
    assert tokens == expected
    assert leases_lost == 1
    assert stats(prefill).kv_leases_expired == 2
    assert_whole(pools.workers)


def worker_pid(worker: Any) -> int:
    return int(ray.get(worker.__ray_call__.remote(lambda _self: os.getpid())))


def process_gone(pid: int) -> bool:
    """True once the process has exited (a zombie has released its memory too)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "zombie" in status


def wait_until_dead(worker: Any, pid: int) -> None:
    """ray.kill returns at once, and Ray may call the actor dead while its process still
    holds its memory (readable by a same-host UCX transfer): wait for both."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(worker.health.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            if process_gone(pid):
                return
        time.sleep(0.05)
    raise AssertionError("the killed worker is still alive")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_worker_killed_before_the_pull(
    policy: str, worker_ray: None, tiny_llama_dir: Path, make_engine: EngineFactory
) -> None:
    pools = start(tiny_llama_dir, kv_transfer_failure=policy)
    try:
        prefill, decode = pools.prefill_workers[0], pools.decode_workers[0]
        first = ray.get(prefill.prefill.remote(EngineRequest("k", PROMPT, greedy(6))))
        assert first.kv_handle is not None
        pid = worker_pid(prefill)
        ray.kill(prefill, no_restart=True)
        wait_until_dead(prefill, pid)
        tokens, last = streamed_tokens(
            decode, EngineRequest("k", PROMPT, greedy(6), first.kv_handle)
        )
        after = stats(decode)
        [sample] = last.samples
        if policy == "recompute":
            assert tokens == colocated(make_engine, {"k": PROMPT}, 6)["k"]
            assert sample.finish_reason == "length"
            assert after.kv_pull_fallbacks == 1 and after.kv_transfer_failures == 0
        else:
            assert sample.finish_reason == "abort"
            assert isinstance(sample.stop_reason, str)
            assert sample.stop_reason.startswith("KV transfer failed: ")
            assert "kv_transfer_failure=recompute" in sample.stop_reason
            assert after.kv_transfer_failures == 1 and after.kv_pull_fallbacks == 0
        assert_whole([decode])
    finally:
        pools.shutdown()
