"""EngineWorker and EngineLoop in-process (no Ray): the loop thread streams outputs, aborts
free blocks, a request failed outside a step still reaches its caller, and a request the
engine failed alone raises RequestFailedError in its stream only."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvrelay.common.messages import EngineRequest, RequestFailedError
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.sampler import Sampler, SamplingRow
from kvrelay.worker.actor import EngineWorker
from kvrelay.worker.deltas import request_deltas
from kvrelay.worker.engine_loop import EngineLoop
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion
from tests.engine.test_disaggregation import prefill
from tests.worker.conftest import TINY_ENGINE_KWARGS


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def test_colocated_worker_streams_the_engine_output(
    tiny_llama_dir: Path, make_engine: EngineFactory
) -> None:
    worker = EngineWorker(EngineArgs(model=str(tiny_llama_dir), **TINY_ENGINE_KWARGS))
    prompts = {f"r{i}": list(range(3 + i, 20 + 2 * i)) for i in range(3)}

    async def one(rid: str) -> list[list[int]]:
        """The sample's tokens so far after each delta."""
        tokens: list[int] = []
        seen = []
        async for delta in request_deltas(worker.loop, EngineRequest(rid, prompts[rid], greedy(6))):
            tokens.extend(delta.samples[0].token_ids)
            seen.append(list(tokens))
        return seen

    async def main() -> dict[str, list[list[int]]]:
        results = await asyncio.gather(*(one(rid) for rid in prompts))
        return dict(zip(prompts, results, strict=True))

    try:
        streamed = asyncio.run(main())
        reference = make_engine()
        for rid, prompt in prompts.items():
            reference.add_request(rid, prompt, greedy(6))
        expected = run_to_completion(reference)
        for rid, seen in streamed.items():
            assert seen[-1] == expected[rid][0]
            assert [len(s) for s in seen] == list(range(1, 7))  # one token per step
        stats = asyncio.run(worker.stats())
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
    finally:
        worker.shutdown()
    assert not worker.health()


def test_abort_mid_stream_frees_the_blocks(tiny_llama_dir: Path) -> None:
    worker = EngineWorker(EngineArgs(model=str(tiny_llama_dir), **TINY_ENGINE_KWARGS))

    async def main() -> None:
        num_tokens = 0
        async for delta in request_deltas(
            worker.loop, EngineRequest("a", list(range(5, 30)), greedy(200))
        ):
            num_tokens += len(delta.samples[0].token_ids)
            if num_tokens == 3:
                break  # leaving the stream aborts the request
        await asyncio.sleep(0)

    try:
        asyncio.run(main())
        stats = asyncio.run(worker.stats())
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_running == 0 and stats.num_waiting == 0
    finally:
        worker.shutdown()


def test_engine_flags_from_the_environment_override_per_pool() -> None:
    from kvrelay.worker.engine_builder import apply_env_overrides

    base = EngineArgs(model="m", max_num_seqs=128, block_size=16)
    env = {"KVRELAY_ENGINE_ARGS": "--max-num-seqs 8 --kv-cache-memory 2GiB --no-prefix-caching"}
    tuned = apply_env_overrides(base, env)
    assert (tuned.max_num_seqs, tuned.kv_cache_memory, tuned.enable_prefix_caching) == (
        8,
        "2GiB",
        False,
    )
    assert tuned.block_size == 16 and tuned.model == "m"  # flags not given keep their values
    assert apply_env_overrides(base, {}) == base
    with pytest.raises(ValueError, match="KVRELAY_ENGINE_ARGS"):
        apply_env_overrides(base, {"KVRELAY_ENGINE_ARGS": "--no-such-flag 1"})


PROMPT = list(range(3, 23))


@pytest.mark.parametrize("failure", ["pull", "mismatch"])
def test_fail_policy_output_reaches_the_caller(make_engine: EngineFactory, failure: str) -> None:
    """kv_transfer_failure="fail" finishes the request outside a step (at the add for a
    mismatched handle, at finish_pull for a failed pull): the loop must still step to hand
    the final output over, or the caller waits forever."""
    handle = prefill(make_engine(role="prefill"), {"r": PROMPT}, greedy(4))["r"]
    engine = make_engine(role="decode", kv_transfer_failure="fail")
    loop = EngineLoop(engine, connector=None)  # no connector: every pull fails
    prompt = PROMPT if failure == "pull" else [*PROMPT[:-1], PROMPT[-1] + 1]

    async def collect() -> list[RequestOutput | int]:
        return [
            output async for output in loop.outputs(EngineRequest("r", prompt, greedy(4), handle))
        ]

    try:
        outputs = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    finally:
        loop.shutdown()
    [final] = outputs
    assert isinstance(final, RequestOutput)
    sample = final.outputs[0]
    assert final.finished and sample.finish_reason == "abort"
    assert isinstance(sample.stop_reason, str) and "KV transfer failed" in sample.stop_reason
    assert engine.stats().kv_transfer_failures == 1
    assert_pool_whole(engine)


def test_a_request_failed_alone_raises_in_its_stream_only(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 12: the engine fails one request (its sampling raises); its caller gets
    RequestFailedError, and the other request on the loop finishes with a clean run's tokens."""
    good = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    bad = SamplingParams(temperature=1.0, top_k=77, max_tokens=8, ignore_eos=True)
    reference = make_engine()
    reference.add_request("good", PROMPT, good)
    expected = run_to_completion(reference)["good"][0]
    original = Sampler._sample

    def faulty(x: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        if any(r.params.top_k == 77 and len(r.output_token_ids) >= 2 for r in rows):
            raise RuntimeError("injected sampling fault")
        return original(x, rows, u)

    monkeypatch.setattr(Sampler, "_sample", staticmethod(faulty))
    engine = make_engine()
    loop = EngineLoop(engine)

    async def collect(rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        final = [o async for o in loop.outputs(EngineRequest(rid, prompt, params))][-1]
        assert isinstance(final, RequestOutput)  # the last item: the finished output
        return final.outputs[0].token_ids

    async def main() -> tuple[list[int] | BaseException, ...]:
        return tuple(
            await asyncio.gather(
                collect("good", PROMPT, good),
                collect("bad", PROMPT[:9], bad),
                return_exceptions=True,
            )
        )

    try:
        got, failed = asyncio.run(asyncio.wait_for(main(), timeout=30))
        stats = asyncio.run(loop.call(lambda e: e.stats()))
    finally:
        loop.shutdown()
    assert isinstance(failed, RequestFailedError) and "could not sample" in str(failed)
    assert got == expected
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
    assert_pool_whole(engine)


def test_the_loop_hands_a_plain_requests_middle_tokens_over_as_rows(
    make_engine: EngineFactory,
) -> None:
    """The loop steps the engine by `step_delta`: a plain request's stream is its first
    cumulative output, then one int per step, then its final output; no output is rebuilt
    for the tokens between. Together they are the tokens a `step`-driven engine gives."""
    reference = make_engine()
    reference.add_request("r", PROMPT, greedy(6))
    expected = run_to_completion(reference)["r"][0]
    loop = EngineLoop(make_engine())

    async def collect() -> list[RequestOutput | int]:
        return [item async for item in loop.outputs(EngineRequest("r", PROMPT, greedy(6)))]

    try:
        items = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    finally:
        loop.shutdown()
    first, *rows, final = items
    assert isinstance(first, RequestOutput) and isinstance(final, RequestOutput)
    assert all(isinstance(row, int) for row in rows) and len(rows) == 4
    assert first.outputs[0].token_ids + rows == final.outputs[0].token_ids[:-1]
    assert final.finished and final.outputs[0].token_ids == expected
    assert_pool_whole(loop.engine)
