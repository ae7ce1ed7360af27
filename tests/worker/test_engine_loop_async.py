"""The worker's engine loop over an engine with async scheduling forced on (engine/
async_step.py): each stream carries what the synchronous engine gives, token for token
(first output, rows, final output), an abort mid-stream ends only its stream, and every block
is free at the end."""

from __future__ import annotations

import asyncio

from kvrelay.common.messages import EngineRequest
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.outputs import RequestOutput
from kvrelay.worker.engine_loop import EngineLoop
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion

PROMPTS = {f"r{i}": [3 + (5 * i + j) % 100 for j in range(6 + 4 * i)] for i in range(4)}
PARAMS = {
    "r0": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    "r1": SamplingParams(temperature=0.0, max_tokens=12),
    "r2": SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True),
    "r3": SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
}


def _tokens(items: list[RequestOutput | int]) -> list[int]:
    """A stream's tokens: cumulative outputs and single-token rows, in order."""
    tokens: list[int] = []
    for item in items:
        if isinstance(item, int):
            tokens.append(item)
        else:
            tokens = list(item.outputs[0].token_ids)
    return tokens


def test_streams_equal_the_synchronous_engine(make_engine: EngineFactory) -> None:
    reference = make_engine(async_scheduling=False)
    for rid, prompt in PROMPTS.items():
        reference.add_request(rid, prompt, PARAMS[rid])
    expected = run_to_completion(reference)
    engine = make_engine(async_scheduling=True)
    loop = EngineLoop(engine)

    async def one(rid: str) -> list[RequestOutput | int]:
        request = EngineRequest(rid, PROMPTS[rid], PARAMS[rid])
        return [item async for item in loop.outputs(request)]

    async def main() -> list[list[RequestOutput | int]]:
        return await asyncio.gather(*(one(rid) for rid in PROMPTS))

    try:
        streams = asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        loop.shutdown()
    for rid, items in zip(PROMPTS, streams, strict=True):
        final = items[-1]
        assert isinstance(final, RequestOutput) and final.finished
        assert _tokens(items) == final.outputs[0].token_ids == expected[rid][0]
    assert engine.overlap is not None and engine.overlap.launched > 0
    assert_pool_whole(engine)


def test_an_abort_mid_stream_ends_it_and_frees_its_blocks(make_engine: EngineFactory) -> None:
    engine = make_engine(async_scheduling=True)
    loop = EngineLoop(engine)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> tuple[list[RequestOutput | int], list[RequestOutput | int]]:
        got: list[RequestOutput | int] = []
        async for item in loop.outputs(EngineRequest("long", PROMPTS["r1"], long)):
            got.append(item)
            if len(got) == 5:
                break  # closing the stream aborts the request
        short = EngineRequest("short", PROMPTS["r0"], PARAMS["r0"])
        rest = [item async for item in loop.outputs(short)]
        return got, rest

    try:
        got, rest = asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        loop.shutdown()
    assert len(_tokens(got)) == 5
    final = rest[-1]
    assert isinstance(final, RequestOutput) and len(final.outputs[0].token_ids) == 8
    assert_pool_whole(engine)
