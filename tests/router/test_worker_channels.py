"""The router's end of a worker's output channel (router/worker_channels.py) over fake worker actors
on the session's Ray cluster: many requests on one channel each get their own tokens, in
order; a consumer that stops reading stalls no other; a worker that dies ends every stream on
its channel with an error the relay migrates on; the next request opens a fresh channel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from kvrelay.common.messages import ChannelItem, EngineRequest
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.local import local_router
from kvrelay.router.types import GenerateRequest
from kvrelay.router.worker_channels import ChannelClosedError, Channels, Inbox, WorkerChannel
from tests.router.fake_worker import FakeState, FakeWorker, model_tokens
from tests.worker.conftest import worker_ray

__all__ = ["worker_ray"]  # the session's Ray cluster, as a fixture of this module

pytestmark = pytest.mark.usefixtures("worker_ray")
WAIT_S = 30.0


def _fake(**faults: Any) -> Any:
    return ray.remote(FakeWorker).options(num_cpus=0).remote("both", **faults)


async def _start(channel: WorkerChannel, request_id: str, prompt: list[int], n: int) -> Inbox:
    tag, inbox = channel.open()
    params = SamplingParams(max_tokens=n)
    await channel.actor.start.remote(
        channel.channel_id, tag, EngineRequest(request_id, prompt, params)
    )
    return inbox


async def _read(inbox: Inbox) -> list[ChannelItem]:
    """A stream's items up to its finished delta."""
    items: list[ChannelItem] = []
    while True:
        item = await inbox.get()
        if isinstance(item, BaseException):
            raise item
        items.append(item)
        if item.delta is None or item.delta.finished:
            return items


async def _whole(actor: Any) -> FakeState:
    """The fake's books once its aborts have landed (they are fire-and-forget)."""
    for _ in range(200):
        state: FakeState = await actor.state.remote()
        if state.whole:
            return state
        await asyncio.sleep(0.05)
    return state


async def test_many_requests_on_one_channel_each_get_their_tokens_in_order() -> None:
    actor = _fake(step_s=0.005)
    channel = Channels().of("w", actor)
    prompts = {f"r{i}": [i + 1, 2 * i + 3, 7] for i in range(12)}
    inboxes = {rid: await _start(channel, rid, p, 6) for rid, p in prompts.items()}
    results = await asyncio.wait_for(
        asyncio.gather(*(_read(inbox) for inbox in inboxes.values())), WAIT_S
    )
    for (rid, prompt), items in zip(prompts.items(), results, strict=True):
        deltas = [item.delta for item in items if item.delta is not None]
        assert {d.request_id for d in deltas} == {rid}  # nothing of another request
        positions = [s.start for d in deltas for s in d.samples]
        assert positions == sorted(positions) == list(range(6))  # in order, no gap
        tokens = [t for d in deltas for s in d.samples for t in s.token_ids]
        assert tokens == model_tokens(prompt, 6)
    assert channel.streams == 12  # open until each consumer closes its tag
    channel.stop()
    ray.kill(actor)


async def test_a_consumer_that_stops_reading_stalls_no_other() -> None:
    actor = _fake(step_s=0.005)
    channels = Channels()
    channel = channels.of("w", actor)
    stuck = await _start(channel, "stuck", [1, 2, 3], 400)  # nobody reads this one
    first = await asyncio.wait_for(stuck.get(), WAIT_S)
    assert not isinstance(first, BaseException)
    others = [await _start(channel, f"o{i}", [i, 9], 20) for i in range(3)]
    done = await asyncio.wait_for(asyncio.gather(*map(_read, others)), WAIT_S)
    assert all(items[-1].delta and items[-1].delta.finished for items in done)
    # The client went away: the relay closes its tag and aborts; the worker frees it.
    tag = next(iter(t for t, inbox in channel._inboxes.items() if inbox is stuck))
    channel.close(tag)
    await actor.abort.remote("stuck")
    assert (await _whole(actor)).whole
    assert channels.of("w", actor) is channel  # the channel lives on for the next request
    channels.close()
    ray.kill(actor)


async def test_a_worker_that_dies_ends_every_stream_on_its_channel() -> None:
    actor = _fake(step_s=0.05)
    channels = Channels()
    channel = channels.of("w", actor)
    inboxes = [await _start(channel, f"d{i}", [i, 4], 1000) for i in range(4)]
    for inbox in inboxes:  # every stream is under way
        assert not isinstance(await asyncio.wait_for(inbox.get(), WAIT_S), BaseException)
    ray.kill(actor)
    for inbox in inboxes:
        while True:
            item = await asyncio.wait_for(inbox.get(), WAIT_S)
            if isinstance(item, BaseException):
                break
        # What the relay migrates on: the worker's hang-up (a dead process's socket closes).
        assert isinstance(item, ChannelClosedError)
    assert channel.broken is not None
    # A stream opened on the broken channel hears of it at once; the registry's next pick
    # of another engine gets a fresh channel.
    _, late = channel.open()
    assert isinstance(late.get_nowait(), ChannelClosedError)
    replacement = _fake()
    fresh = channels.of("w", replacement)
    assert fresh is not channel
    items = await asyncio.wait_for(_read(await _start(fresh, "after", [3], 3)), WAIT_S)
    assert [t for i in items if i.delta for s in i.delta.samples for t in s.token_ids] == (
        model_tokens([3], 3)
    )
    channels.close()
    ray.kill(replacement)


async def test_the_same_request_id_twice_on_a_channel_never_mixes_the_runs() -> None:
    """A recompute after a lost lease runs the request id again at the same worker: the first
    run's late final (abort) delta must not end the second run."""
    actor = _fake(step_s=0.01)
    channel = Channels().of("w", actor)
    tag, first = channel.open()
    params = SamplingParams(max_tokens=500)
    await actor.start.remote(channel.channel_id, tag, EngineRequest("same", [5, 6], params))
    assert not isinstance(await asyncio.wait_for(first.get(), WAIT_S), BaseException)
    channel.close(tag)
    actor.abort.remote("same")
    await _whole(actor)
    again = await _start(channel, "same", [5, 6], 4)
    items = await asyncio.wait_for(_read(again), WAIT_S)
    last = items[-1].delta
    assert last is not None and last.samples[-1].finish_reason == "length"
    assert [s.start for i in items if i.delta for s in i.delta.samples] == [0, 1, 2, 3]
    channel.stop()
    ray.kill(actor)


async def test_a_batch_of_several_steps_still_streams_one_chunk_per_step() -> None:
    """With no step time the fake's deltas pile up into batches of many steps; the client
    still gets one chunk per token (the router's merge coalesces only what a slow client
    leaves waiting), as a stream per request gave."""
    actor = _fake(step_s=0.0)
    router = await local_router([actor], config=RouterConfig(max_local_prefill_tokens=0))
    prompt = [4, 8, 15, 16]
    request = GenerateRequest("burst", prompt, SamplingParams(max_tokens=24))
    chunks = [chunk async for chunk in router.generate(request)]
    per_chunk = [len(c.token_ids) for chunk in chunks for c in chunk.choices if c.token_ids]
    assert per_chunk == [1] * 24
    tokens = [t for chunk in chunks for c in chunk.choices for t in c.token_ids]
    assert tokens == model_tokens(prompt, 24)
    router.relay.channels.close()
    ray.kill(actor)


async def test_closing_the_channels_stops_their_readers_and_aborts_the_streams() -> None:
    """At shutdown the router closes its channels: every stream hears of it at once, the
    readers hang up, and the worker frees the requests."""
    actor = _fake(step_s=0.02)
    channels = Channels()
    channel = channels.of("w", actor)
    inbox = await _start(channel, "long", [2, 7], 1000)
    assert not isinstance(await asyncio.wait_for(inbox.get(), WAIT_S), BaseException)
    channels.close()
    await asyncio.wait_for(asyncio.wait({channel._reader}), WAIT_S)
    while not isinstance(item := inbox.get_nowait(), BaseException):
        assert item.delta is not None  # deltas already delivered, then the error
    assert isinstance(item, ChannelClosedError)
    assert (await _whole(actor)).whole  # closing the channel aborted the request there
    ray.kill(actor)
