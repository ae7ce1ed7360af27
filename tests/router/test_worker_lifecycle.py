"""Worker lifecycle under a router, with fake worker actors on the session's real Ray cluster:
every registry call is bounded (a hung actor stalls neither a join nor the refresh loop: stats,
dead-worker removal and discovery go on), draining (no new requests, those in flight finish,
every router replica sees it), and revisions paired end to end, migration included."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import ray

from kvrelay.common.messages import DrainState
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.local import complete, local_router
from kvrelay.router.router import Router
from kvrelay.router.types import GenerateChunk, GenerateRequest
from kvrelay.router.workers import WorkerRegistry
from tests.router.fake_worker import FakeState, FakeWorker, HangingWorker, model_tokens
from tests.worker.conftest import worker_ray

__all__ = ["worker_ray"]  # the session's Ray cluster, as a fixture of this module

PROMPT = list(range(1, 21))
WAIT_S = 10.0  # what must happen soon (a shared 2-core machine: generous)
OLD, NEW = "0a1b2c3d4e5f", "f5e4d3c2b1a0"
# A migrating stream: 40 tokens of 0.2 s at the dying worker (8 s) always outlast the joins
# and the kill; its end may then take the rest of those tokens at the spare.
MIGRATING_TOKENS = 40
MIGRATION_WAIT_S = 30.0


class Actors:
    """Starts fake worker actors for one test and kills them all at its end."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def fake(self, role: str, engine_id: str, **kwargs: Any) -> Any:
        return self._keep(
            ray.remote(FakeWorker).options(num_cpus=0).remote(role, engine_id, **kwargs)
        )

    def hanging(self, role: str, engine_id: str, *hang_in: str, **kwargs: Any) -> Any:
        options = ray.remote(HangingWorker).options(num_cpus=0)
        return self._keep(options.remote(role, engine_id=engine_id, hang_in=hang_in, **kwargs))

    def _keep(self, actor: Any) -> Any:
        self.started.append(actor)
        return actor

    async def up(self) -> None:
        """Wait until every actor started so far is up (a process start takes seconds here;
        `state` never hangs)."""
        await bounded(asyncio.gather(*(a.state.remote() for a in self.started)), 60)


@pytest.fixture
def actors(worker_ray: None) -> Iterator[Actors]:
    made = Actors()
    yield made
    for actor in made.started:
        ray.kill(actor)


async def bounded(what: Any, seconds: float = WAIT_S) -> Any:
    """`what` awaited, failing the test if it takes longer (it would hang forever)."""
    async with asyncio.timeout(seconds):
        return await what


async def state(actor: Any) -> FakeState:
    result: FakeState = await actor.state.remote()
    return result


async def eventually(check: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# -- every registry call is bounded --


async def test_add_gives_up_on_a_worker_that_never_comes_up(actors: Actors) -> None:
    registry = WorkerRegistry(stats_timeout_s=0.5, join_timeout_s=1.0)
    never_up = actors.hanging("decode", "never-up", "health")
    stuck = actors.hanging("decode", "stuck-in-describe", "describe")
    good = actors.fake("decode", "good")
    await actors.up()
    with pytest.raises(TimeoutError):
        await bounded(registry.add(never_up))
    with pytest.raises(TimeoutError):
        await bounded(registry.add(stuck))
    assert registry.workers == {}
    # Neither holds the registry's lock: a good worker still joins.
    assert (await bounded(registry.add(good))).worker_id == "good"


async def test_a_hung_worker_never_stalls_the_refresh_loop(actors: Actors) -> None:
    """Before: discovery awaited each new worker's join inline, with no timeout, so a worker
    stuck in its constructor (a re-created pod waiting for a name) stalled the router's whole
    refresh loop: no stats, no dead-worker removal, no discovery, for ever."""
    prefill, decode = actors.fake("prefill", "p0"), actors.fake("decode", "d0")
    doomed = actors.fake("decode", "d1")
    stuck = actors.hanging("decode", "stuck", "health", "describe")
    found = [prefill, decode, doomed, stuck]
    await actors.up()

    async def discover() -> list[Any]:
        return list(found)

    registry = WorkerRegistry(stats_timeout_s=0.5, join_timeout_s=1.0, discover=discover)
    await bounded(registry.refresh())  # starts the joins, waits for none
    await eventually(lambda: _joined(registry, {"p0", "d0", "d1"}), "the good workers' join")
    assert "stuck" not in registry.workers

    # The loop goes on around the stuck join: stats are polled, a dead worker is removed.
    await prefill.configure.remote(prefill_s=0.01)
    seen = registry.workers["d0"].last_seen
    ray.kill(doomed)
    await bounded(registry.refresh())
    assert "d1" not in registry.workers
    assert registry.workers["d0"].last_seen > seen

    # The stuck join gave up (join_timeout_s) and is retried: once the worker answers, it joins.
    await asyncio.sleep(1.2)
    await stuck.hang.remote()
    await bounded(registry.refresh())
    await eventually(lambda: _joined(registry, {"p0", "d0", "stuck"}), "the retried join")
    await registry.close()


async def _joined(registry: WorkerRegistry, ids: set[str]) -> bool:
    return set(registry.workers) == ids


async def test_a_worker_that_hangs_after_joining_is_removed_without_stalling(
    actors: Actors,
) -> None:
    registry = WorkerRegistry(stats_timeout_s=0.3, dead_after_s=3.0)
    hung = actors.hanging("decode", "hangs-later")
    await actors.up()
    await bounded(registry.add(hung))
    await hung.hang.remote("status", "stats", "drain")
    assert await bounded(registry.drain({"fake-pod"})) == []  # no answer: not drained
    await bounded(registry.refresh())  # slow, not dead yet: kept
    assert "hangs-later" in registry.workers
    await asyncio.sleep(3.0)
    await bounded(registry.refresh())
    assert "hangs-later" not in registry.workers
    await registry.close()


# -- draining --


async def collect_stream(chunks: AsyncIterator[GenerateChunk]) -> list[int]:
    tokens: list[int] = []
    async for chunk in chunks:
        for choice in chunk.choices:
            tokens.extend(choice.token_ids)
    return tokens


async def router_over(*workers: Any) -> Router:
    """Every prompt goes through a prefill worker (no local prefill)."""
    return await local_router(workers, config=RouterConfig(max_local_prefill_tokens=0))


async def test_a_draining_worker_gets_no_new_requests_and_finishes_its_own(
    actors: Actors,
) -> None:
    prefill = actors.fake("prefill", "p0", pod="pod-p")
    leaving = actors.fake("decode", "d-leaving", pod="pod-a", step_s=0.05)
    staying = actors.fake("decode", "d-staying", pod="pod-b")
    router = await router_over(prefill, leaving)
    params = SamplingParams(max_tokens=30)
    streaming = asyncio.create_task(
        collect_stream(router.generate(GenerateRequest("long", PROMPT, params)))
    )
    await eventually(lambda: _live_at(leaving, "long"), "the stream at the leaving worker")
    await router.registry.add(staying)

    drained = await bounded(router.registry.drain({"pod-a", "pod-gone"}))
    assert [w.worker_id for w in drained] == ["d-leaving"]
    entry = router.registry.workers["d-leaving"]
    assert entry.draining and entry.requests_in_flight >= 1

    short = SamplingParams(max_tokens=3)
    for i in range(4):
        out = await bounded(complete(router, PROMPT, short, f"new{i}"))
        assert out.choices[0].token_ids == model_tokens(PROMPT, 3)
    staying_state, leaving_state = await state(staying), await state(leaving)
    assert staying_state.called("start") == [f"new{i}" for i in range(4)]
    assert leaving_state.called("start") == ["long"]  # nothing new

    # The stream in flight at the draining worker goes on to its end.
    assert await bounded(streaming) == model_tokens(PROMPT, 30)
    await bounded(router.registry.refresh())
    assert router.registry.workers["d-leaving"].requests_in_flight == 0  # drained

    # Another router replica sees the flag the worker keeps, at its join and when it polls.
    replica = WorkerRegistry()
    for worker in (prefill, leaving, staying):
        await bounded(replica.add(worker))
    assert replica.workers["d-leaving"].draining
    assert [w.worker_id for w in replica.healthy(router.registry.workers["d-leaving"].role)] == [
        "d-staying"
    ]

    # Ray restarts the drained actor in place (a new life, without the flag): it joins drained.
    reborn = actors.fake("decode", "d-reborn", pod="pod-a")
    assert (await bounded(router.registry.add(reborn))).draining
    assert (await reborn.status.remote()).state is DrainState.DRAINING
    assert "pod-a" in replica.draining_pods  # the replica learnt the pod from the flag


async def _live_at(actor: Any, request_id: str) -> bool:
    return request_id in (await state(actor)).requests


# -- revisions, end to end --


def fresh_prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + token for token in PROMPT]


async def test_prefill_and_decode_pair_within_the_routers_revision(
    actors: Actors, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_p = actors.fake("prefill", "p-old", revision=OLD, pod="old-p")
    old_d = actors.fake("decode", "d-old", revision=OLD, pod="old-d")
    new_p = actors.fake("prefill", "p-new", revision=NEW, pod="new-p")
    new_d = actors.fake("decode", "d-new", revision=NEW, pod="new-d")
    monkeypatch.setenv("KVRELAY_GENERATION", NEW)
    router = await router_over(old_p, old_d, new_p, new_d)
    params = SamplingParams(max_tokens=3)
    for i in range(3):  # prompts cached nowhere: each one is prefilled, then relayed
        await bounded(complete(router, fresh_prompt(i), params, f"n{i}"))
    new_p_state, new_d_state = await state(new_p), await state(new_d)
    assert new_p_state.called("prefill") == ["n0", "n1", "n2"]
    assert new_p_state.bound_to == ("d-new",) * 3  # each handle bound to its own revision's D
    assert new_d_state.called("start") == ["n0", "n1", "n2"]
    assert (await state(old_p)).calls == () and (await state(old_d)).calls == ()

    # Its revision's decoder drains away: the old revision serves, paired with itself.
    await bounded(router.registry.drain({"new-d"}))
    for i in range(3):
        await bounded(complete(router, fresh_prompt(10 + i), params, f"o{i}"))
    assert (await state(old_p)).bound_to == ("d-old",) * 3
    assert (await state(new_p)).called("prefill") == ["n0", "n1", "n2"]  # never paired with D-old


async def test_a_migrated_stream_resumes_in_its_own_revision(
    actors: Actors, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill = actors.fake("prefill", "p-new", revision=NEW)
    dying = actors.fake("decode", "d-new", revision=NEW, step_s=0.2)
    other_revision = actors.fake("decode", "d-old", revision=OLD)
    # Started now, joined mid-stream: a process start takes seconds on a loaded machine,
    # longer than the stream would wait.
    spare = actors.fake("decode", "d-new-2", revision=NEW)
    await actors.up()
    monkeypatch.setenv("KVRELAY_GENERATION", NEW)
    router = await router_over(prefill, dying, other_revision)
    params = SamplingParams(max_tokens=MIGRATING_TOKENS)
    streaming = asyncio.create_task(
        collect_stream(router.generate(GenerateRequest("moving", PROMPT, params)))
    )
    await eventually(lambda: _live_at(dying, "moving"), "the stream at d-new")
    await bounded(router.registry.add(spare))
    ray.kill(dying)
    assert await bounded(streaming, MIGRATION_WAIT_S) == model_tokens(PROMPT, MIGRATING_TOKENS)
    assert [rid for rid, _ in (await state(spare)).resumed] == ["moving"]
    assert (await state(other_revision)).calls == ()


# -- KV that does not travel is said in the router's log --


async def test_a_decode_workers_failed_pulls_are_a_warning_at_the_router(
    actors: Actors, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed pull recomputes at the decode worker, correct but slow; its own log names the
    peer and address. The router, which operators read, says it too when it polls."""
    prefill = actors.fake("prefill", "p0", pod="pod-p")
    decode = actors.fake("decode", "d0", pod="pod-d", pull_fails=True)
    router = await router_over(prefill, decode)
    out = await bounded(complete(router, fresh_prompt(50), SamplingParams(max_tokens=3)))
    assert out.choices[0].token_ids == model_tokens(fresh_prompt(50), 3)  # recomputed
    with caplog.at_level(logging.WARNING, logger="kvrelay.router.kv_reach"):
        await bounded(router.registry.refresh())
        await bounded(router.registry.refresh())  # nothing new: no second warning
    (message,) = [r.getMessage() for r in caplog.records if r.name == "kvrelay.router.kv_reach"]
    assert "d0" in message and "1 KV pull(s) failed" in message


async def test_a_stream_migrates_within_its_revision_even_after_the_serving_one_changed(
    actors: Actors, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream started on the old revision (the router's own had no worker yet); then its
    own revision comes up, and the stream's decoder dies: it must resume on a decoder of the
    old revision (the same model and engine), not on the now-serving new one."""
    old_p = actors.fake("prefill", "p-old", revision=OLD)
    dying = actors.fake("decode", "d-old", revision=OLD, step_s=0.2)
    spare = actors.fake("decode", "d-old-2", revision=OLD)
    new_p = actors.fake("prefill", "p-new", revision=NEW)
    new_d = actors.fake("decode", "d-new", revision=NEW)
    await actors.up()  # all started before the stream; joined mid-stream
    monkeypatch.setenv("KVRELAY_GENERATION", NEW)
    router = await router_over(old_p, dying)
    params = SamplingParams(max_tokens=MIGRATING_TOKENS)
    streaming = asyncio.create_task(
        collect_stream(router.generate(GenerateRequest("older", PROMPT, params)))
    )
    await eventually(lambda: _live_at(dying, "older"), "the stream at d-old")
    for worker in (spare, new_p, new_d):
        await bounded(router.registry.add(worker))
    assert router.registry.serving_revision() == NEW
    ray.kill(dying)
    assert await bounded(streaming, MIGRATION_WAIT_S) == model_tokens(PROMPT, MIGRATING_TOKENS)
    assert (await state(new_d)).calls == ()
    assert [rid for rid, _ in (await state(spare)).resumed] == ["older"]
