"""Prefill and decode workers as real Ray actors, KV moved by NIXL or gRPC: greedy outputs
equal a colocated in-process engine; a failed pull recomputes; nothing leaks."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from kvrelay.engine.sampling import SamplingParams
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
    async def main() -> list[list[int]]:
        outs = await asyncio.gather(*(pools.generate(p, greedy(8)) for p in PROMPTS.values()))
        return [out.outputs[0].token_ids for out in outs]

    before = ray.get(pools.decode_workers[0].stats.remote()).kv_pull_fallbacks
    results = dict(zip(PROMPTS, asyncio.run(main()), strict=True))
    assert results == colocated(make_engine, PROMPTS, 8)
    assert ray.get(pools.decode_workers[0].stats.remote()).kv_pull_fallbacks == before
    assert_no_leaks(pools)


def test_failed_pull_recomputes_the_prompt(pools: Pools, make_engine: EngineFactory) -> None:
    prefill, decode = pools.prefill_workers[0], pools.decode_workers[0]
    prompt = PROMPTS["a"]
    first = ray.get(prefill.prefill.remote("gone", prompt, greedy(6)))
    assert first.kv_handle is not None
    # A handle from a prefill worker the decode worker never met: the pull fails.
    stale = dataclasses.replace(first.kv_handle, engine_id="restarted-elsewhere")
    before = ray.get(decode.stats.remote()).kv_pull_fallbacks
    out = ray.get(decode.generate_final.remote("gone", prompt, greedy(6), stale))
    assert ray.get(prefill.release_kv.remote("gone"))
    assert out.outputs[0].token_ids == colocated(make_engine, {"gone": prompt}, 6)["gone"]
    assert ray.get(decode.stats.remote()).kv_pull_fallbacks == before + 1
    assert_no_leaks(pools)
