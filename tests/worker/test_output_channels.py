"""A worker's output channel (worker/output_channels.py) in-process, on one event loop: many streams
batched into one, each stream's items in order under its own tag, failures as the router's
words, and a closed channel aborting what still runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvrelay.common.messages import (
    ChannelItem,
    EngineRequest,
    OutputDelta,
    RequestFailedError,
    SampleDelta,
)
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.stream_wire import read_batch
from kvrelay.router.worker_channels import connect
from kvrelay.worker.output_channels import OutputChannel, failure_item
from tests.worker.scripted_endpoint import ScriptedEndpoint


def _delta(request_id: str, start: int, token: int, finished: bool = False) -> OutputDelta:
    reason = "length" if finished else None
    return OutputDelta(
        request_id, [SampleDelta(0, start, [token], finish_reason=reason)], finished, 3
    )


async def _tokens(
    request_id: str, count: int, step: asyncio.Event | None = None
) -> AsyncIterator[OutputDelta]:
    """`count` deltas, one per turn of the loop (or per set of `step`)."""
    for i in range(count):
        if step is not None:
            await step.wait()
            step.clear()
        else:
            await asyncio.sleep(0)
        yield _delta(request_id, i, 100 + i, finished=i == count - 1)


async def _collect(channel: OutputChannel, want: int) -> list[list[ChannelItem]]:
    """Batches until `want` items have come."""
    batches: list[list[ChannelItem]] = []
    async for batch in channel.batches():
        batches.append(batch)
        if sum(map(len, batches)) >= want:
            break
    return batches


async def test_many_streams_share_batches_and_keep_their_order() -> None:
    channel = OutputChannel()
    for tag in range(8):
        channel.start(tag, _tokens(f"r{tag}", 5))
    batches = await asyncio.wait_for(_collect(channel, 40), 10)
    items = [item for batch in batches for item in batch]
    assert len(items) == 40
    # Streams advancing together share batches: far fewer objects than deltas.
    assert len(batches) < 40 / 2
    for tag in range(8):
        deltas = [item.delta for item in items if item.tag == tag]
        assert all(d is not None and d.request_id == f"r{tag}" for d in deltas)
        assert [d.samples[0].start for d in deltas if d] == [0, 1, 2, 3, 4]
        assert [d.finished for d in deltas if d] == [False] * 4 + [True]


async def test_a_batch_holds_what_came_since_the_last_one() -> None:
    channel = OutputChannel()
    steps = [asyncio.Event(), asyncio.Event()]
    channel.start(0, _tokens("a", 3, steps[0]))
    channel.start(1, _tokens("b", 3, steps[1]))
    batches = channel.batches()
    for step in steps:  # both streams make one delta in the same turn of the loop
        step.set()
    first = await asyncio.wait_for(anext(batches), 5)
    assert sorted(item.tag for item in first) == [0, 1]
    await batches.aclose()


async def test_failures_go_out_in_the_routers_words() -> None:
    async def failing(exc: Exception) -> AsyncIterator[OutputDelta]:
        yield _delta("x", 0, 1)
        raise exc

    channel = OutputChannel()
    channel.start(0, failing(RequestFailedError("out of blocks")))
    channel.start(1, failing(ValueError("prompt too long")))
    channel.start(2, failing(KeyError("internal detail")))
    items = [i for b in await asyncio.wait_for(_collect(channel, 6), 5) for i in b]
    errors = {item.tag: (item.error_kind, item.error) for item in items if item.delta is None}
    assert errors == {
        0: ("failed", "out of blocks"),
        1: ("invalid", "prompt too long"),
        2: ("internal", "KeyError"),  # no internals on the wire
    }
    assert failure_item(7, RuntimeError("x")).tag == 7


async def test_closing_the_channel_aborts_the_streams_still_running() -> None:
    ended: list[str] = []

    async def endless(name: str) -> AsyncIterator[OutputDelta]:
        try:
            i = 0
            while True:
                await asyncio.sleep(0.001)
                yield _delta(name, i, i)
                i += 1
        finally:
            ended.append(name)  # a worker's stream aborts its request here

    channel = OutputChannel()
    channel.start(0, endless("a"))
    channel.start(1, endless("b"))
    batches = channel.batches()
    await asyncio.wait_for(anext(batches), 5)
    await batches.aclose()  # the router went away
    for _ in range(10):
        await asyncio.sleep(0.01)
    assert sorted(ended) == ["a", "b"]
    assert channel.closed
    with pytest.raises(RuntimeError, match="closed"):
        channel.start(2, endless("c"))


async def test_a_tag_is_used_once_at_a_time() -> None:
    channel = OutputChannel()
    channel.start(0, _tokens("a", 100))
    with pytest.raises(ValueError, match="tag 0"):
        channel.start(0, _tokens("a", 1))
    channel.close()


async def test_endpoint_routes_each_routers_requests_to_its_own_channel() -> None:
    worker = ScriptedEndpoint()
    params = SamplingParams(max_tokens=4)
    router_a, router_b = "a" * 32, "b" * 32
    # Two routers, each with its channel; a start may come before its channel is opened.
    await worker.start(router_a, 0, EngineRequest("a0", [1, 2], params))
    migrated = EngineRequest("b0", [5], params, resume_output_token_ids=[9, 9])
    await worker.start(router_b, 0, migrated)
    seen: dict[str, list[ChannelItem]] = {}

    async def listen(channel_id: str, want: int) -> None:
        items = seen.setdefault(channel_id, [])
        reader, writer = await connect(await worker.open_channel(channel_id))
        while len(items) < want and (batch := await read_batch(reader)) is not None:
            items.extend(batch)
        writer.close()

    await asyncio.wait_for(asyncio.gather(listen(router_a, 4), listen(router_b, 2)), 5)
    assert {i.delta.request_id for i in seen[router_a] if i.delta} == {"a0"}
    assert [i.delta.samples[0].start for i in seen[router_b] if i.delta] == [2, 3]
    assert worker.started == ["a0", "b0"]
    for _ in range(100):  # the hang-ups land on the worker's side
        if not worker.channels.ids:
            break
        await asyncio.sleep(0.01)
    assert not worker.channels.ids  # a channel whose listener left is gone
    worker.channels.close()


@pytest.mark.parametrize("channel_id", ["", "x" * 32, "A" * 32, "a" * 31, "é" * 32])
async def test_a_channel_id_that_is_no_uuid_hex_is_refused(channel_id: str) -> None:
    with pytest.raises(ValueError, match="hex digits"):
        await ScriptedEndpoint().open_channel(channel_id)
