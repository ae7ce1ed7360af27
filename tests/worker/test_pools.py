"""Prefill and decode workers as real Ray actors, KV moved by NIXL or gRPC, requests sent
through the router's relay: greedy outputs equal a colocated in-process engine; a failed pull
recomputes; nothing leaks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import ray

from kvrelay.common.messages import EngineRequest, OutputDelta
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.local import complete, local_router
from kvrelay.router.worker_channels import WorkerChannel
from kvrelay.worker.pools import Pools
from tests.engine.conftest import EngineFactory, run_to_completion
from tests.worker.conftest import TINY_ENGINE_KWARGS

PROMPTS = {
    "a": list(range(3, 23)),  # five full blocks of 4
    "b": [7, 9, 11, 13, 15, 17, 19],
    "c": [100, 5, 42, 42, 8, 77, 3, 64, 90, 12, 6],
}


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def pools(
    request: pytest.FixtureRequest, worker_ray: None, tiny_llama_dir: Path
) -> Iterator[Pools]:
    started = Pools.start(
        str(tiny_llama_dir), transfer_backend=request.param, engine_kwargs=TINY_ENGINE_KWARGS
    )
    yield started
    started.shutdown()


async def relay_tokens(
    workers: Sequence[Any], prompts: Sequence[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Greedy tokens of each prompt, sent through a router's relay over `workers`; every prompt
    is prefilled by a prefill worker and pulled by a decode worker (no local prefill)."""
    router = await local_router(workers, config=RouterConfig(max_local_prefill_tokens=0))
    outs = await asyncio.gather(*(complete(router, prompt, params) for prompt in prompts))
    return [out.choices[0].token_ids for out in outs]


def streamed_tokens(worker: Any, request: EngineRequest) -> tuple[list[int], OutputDelta]:
    """`request` started on the worker's output channel (router/worker_channels.py's end of it,
    as the relay starts one, with no relay around it): all its tokens, and its last delta."""

    async def read() -> tuple[list[int], OutputDelta]:
        channel = WorkerChannel(worker)
        tag, inbox = channel.open()
        tokens: list[int] = []
        try:
            await worker.start.remote(channel.channel_id, tag, request)
            while True:
                item = await asyncio.wait_for(inbox.get(), 60)
                if isinstance(item, BaseException):
                    raise item
                assert item.delta is not None, item.error
                for sample in item.delta.samples:
                    tokens[sample.start :] = sample.token_ids
                if item.delta.finished:
                    return tokens, item.delta
        finally:
            channel.stop()

    return asyncio.run(read())


def colocated(
    make_engine: EngineFactory, prompts: dict[str, list[int]], tokens: int
) -> dict[str, list[int]]:
    engine = make_engine()
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(tokens))
    return {rid: samples[0] for rid, samples in run_to_completion(engine).items()}


def assert_no_leaks(pools: Pools) -> None:
    for stats in pools.stats():
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_leases == 0 and stats.num_pulling == 0
        assert stats.num_running == 0 and stats.num_waiting == 0


def test_disaggregated_equals_colocated(pools: Pools, make_engine: EngineFactory) -> None:
    decode = pools.decode_workers[0]
    before = ray.get(decode.stats.remote())
    tokens = asyncio.run(relay_tokens(pools.workers, list(PROMPTS.values()), greedy(8)))
    results = dict(zip(PROMPTS, tokens, strict=True))
    assert results == colocated(make_engine, PROMPTS, 8)
    after = ray.get(decode.stats.remote())
    assert after.kv_pull_fallbacks == before.kv_pull_fallbacks
    assert after.kv_bytes_pulled > before.kv_bytes_pulled  # the KV really travelled
    assert_no_leaks(pools)


def test_the_engines_run_unniced(pools: Pools) -> None:
    """The session's Ray cluster starts its workers at Ray's nice 15 (it is not started by
    Pools.start): each engine raised every thread of its process back to 0 (we run as root)."""
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs CAP_SYS_NICE")
    for worker in pools.workers:
        pid = ray.get(worker.describe.remote()).pid
        tasks = os.listdir(f"/proc/{pid}/task")
        assert [os.getpriority(os.PRIO_PROCESS, int(t)) for t in tasks] == [0] * len(tasks)


def test_each_worker_froze_its_start_up_objects(pools: Pools) -> None:
    """Out of the garbage collector's full walks (engine_builder.freeze_start_up_objects):
    without it a full collection stalled one step in ~100 for ~190 ms at 256 requests."""
    import gc

    for worker in pools.workers:
        frozen = ray.get(worker.__ray_call__.remote(lambda _: gc.get_freeze_count()))
        assert frozen > 10_000  # the model, torch and Ray: far more than a handful


def test_failed_pull_recomputes_the_prompt(pools: Pools, make_engine: EngineFactory) -> None:
    prefill, decode = pools.prefill_workers[0], pools.decode_workers[0]
    prompt = PROMPTS["a"]
    first = ray.get(prefill.prefill.remote(EngineRequest("gone", prompt, greedy(6))))
    assert first.kv_handle is not None
    # A handle from a prefill worker the decode worker never met: the pull fails.
    stale = dataclasses.replace(first.kv_handle, engine_id="restarted-elsewhere")
    before = ray.get(decode.stats.remote()).kv_pull_fallbacks
    tokens, _ = streamed_tokens(decode, EngineRequest("gone", prompt, greedy(6), stale))
    assert ray.get(prefill.release_kv.remote("gone"))
    assert tokens == colocated(make_engine, {"gone": prompt}, 6)["gone"]
    assert ray.get(decode.stats.remote()).kv_pull_fallbacks == before + 1
    assert_no_leaks(pools)


def test_a_handle_bound_to_another_decode_engine_is_refused(
    pools: Pools, make_engine: EngineFactory
) -> None:
    """The pull is bound to the decode engine the router named: a handle the prefill worker
    bound to another engine is refused (NIXL cannot refuse a one-sided READ, so gRPC only),
    and the decode worker recomputes; bound to it, the KV travels. A decode worker serves no
    KV: it publishes no metadata."""
    prefill, decode = pools.prefill_workers[0], pools.decode_workers[0]
    with pytest.raises(ray.exceptions.RayTaskError, match="only a prefill worker"):
        ray.get(decode.kv_metadata.remote())
    decode_id = ray.get(decode.describe.remote()).engine_id
    # Prompts no other test sends: a prefix-cache hit at the decode worker would pull nothing.
    prompts = {"other": [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20], "mine": [50, 40, 30, 20, 10, 1, 2, 3]}
    grpc_only = ray.get(prefill.kv_metadata.remote()).backend == "grpc"
    for rid, bound_to in (("other", "another-decode-engine"), ("mine", decode_id)):
        prompt, expected = prompts[rid], colocated(make_engine, {rid: prompts[rid]}, 4)[rid]
        first = ray.get(prefill.prefill.remote(EngineRequest(rid, prompt, greedy(4)), bound_to))
        before = ray.get(decode.stats.remote())
        tokens, _ = streamed_tokens(decode, EngineRequest(rid, prompt, greedy(4), first.kv_handle))
        assert ray.get(prefill.release_kv.remote(rid))
        assert tokens == expected
        after = ray.get(decode.stats.remote())
        refused = rid == "other" and grpc_only
        assert after.kv_pull_fallbacks == before.kv_pull_fallbacks + refused
        assert (after.kv_bytes_pulled > before.kv_bytes_pulled) == (not refused)
    assert_no_leaks(pools)
