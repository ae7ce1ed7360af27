"""The relay (router/relay.py) on its failure paths, through fake worker actors on a real local
Ray cluster: a lease lost before the pull, a failed pull, a prefill or decode worker that dies,
a client that leaves at every stage, and n > 1. Every test ends with every surviving fake
whole: no live request, no lease, no block in use (aborts are fire-and-forget, so it polls)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import ray

from kvrelay.common.messages import sample_request_id
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.local import complete, local_router
from kvrelay.router.request_errors import UnavailableError
from kvrelay.router.router import Router
from kvrelay.router.types import GenerateChunk, GenerateRequest
from tests.router.fake_worker import KV_TRANSFER_FAILED, FakeState, FakeWorker, model_tokens
from tests.worker.conftest import worker_ray

__all__ = ["worker_ray"]  # the session's Ray cluster, as a fixture of this module

PROMPT = list(range(1, 21))  # five blocks of 4
MAX_TOKENS = 8
EXPECTED = model_tokens(PROMPT, MAX_TOKENS)
SLOW_S = 30.0  # a stage that lasts until the test ends it (kill, cancel)
WAIT_S = 5.0  # how long a test waits for what must happen soon


def params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, **kwargs})


class Pool:
    """The fake actors of this module, reused from test to test (a fresh one after a kill):
    starting an actor is the slow part of these tests."""

    def __init__(self) -> None:
        self.actors: dict[tuple[str, str], Any] = {}

    def get(self, role: str, engine_id: str) -> Any:
        key = (role, engine_id)
        if key not in self.actors:
            self.actors[key] = ray.remote(FakeWorker).options(num_cpus=0).remote(role, engine_id)
        return self.actors[key]

    def kill(self, actor: Any) -> None:
        ray.kill(actor)
        self.actors = {k: a for k, a in self.actors.items() if a is not actor}


class Cluster:
    """The fakes a test uses, each reset to the faults given, and a router over them."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.router: Router | None = None

    async def start(self, role: str, engine_id: str, **faults: Any) -> Any:
        actor = self.pool.get(role, engine_id)
        before: FakeState = await actor.reset.remote(**faults)
        if not before.whole:  # an earlier test failed: this one starts on a fresh fake
            self.pool.kill(actor)
            actor = self.pool.get(role, engine_id)
            await actor.reset.remote(**faults)
        return actor

    def kill(self, actor: Any) -> None:
        self.pool.kill(actor)

    async def make_router(self, *workers: Any, **options: Any) -> Router:
        """A router over `workers` that sends every prompt through a prefill worker."""
        config = RouterConfig(**{"max_local_prefill_tokens": 0, **options})
        self.router = await local_router(workers, config=config)
        return self.router

    async def assert_whole(self, *survivors: Any) -> list[FakeState]:
        """Every surviving fake ends whole, and the router holds nothing at any worker."""
        states: list[FakeState] = []
        deadline = time.monotonic() + WAIT_S
        while True:
            states = list(await asyncio.gather(*(a.state.remote() for a in survivors)))
            if all(s.whole for s in states) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert all(s.whole for s in states), [s for s in states if not s.whole]
        if self.router is not None:
            assert self.router.num_active == 0
            workers = self.router.registry.workers.values()
            assert {w.worker_id: w.in_flight for w in workers} == {w.worker_id: 0 for w in workers}
        return states


@pytest.fixture(scope="module")
def pool(worker_ray: None) -> Iterator[Pool]:
    p = Pool()
    yield p
    for actor in list(p.actors.values()):
        p.kill(actor)


@pytest.fixture
def cluster(pool: Pool) -> Cluster:
    return Cluster(pool)


_request_ids = itertools.count()


@pytest.fixture
def rid() -> str:
    """A request id of its own per test (a late call of an earlier test cannot pass for it)."""
    return f"r{next(_request_ids)}"


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def live_at(actor: Any, request_id: str) -> bool:
    state: FakeState = await actor.state.remote()
    return request_id in state.requests


async def aborted_at(actor: Any, request_id: str) -> bool:
    state: FakeState = await actor.state.remote()
    return request_id in state.called("abort")


def decisions(router: Router, decision: str) -> float:
    value: float = router.metrics.decisions.labels(decision)._value.get()
    return value


class Client:
    """A streaming client of one request: reads chunks, then leaves (or reads to the end)."""

    def __init__(self, router: Router, request_id: str, **kwargs: Any) -> None:
        self.request_id = request_id
        request = GenerateRequest(request_id, PROMPT, params(**kwargs))
        self.chunks: AsyncIterator[GenerateChunk] = router.generate(request)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.task: asyncio.Task[None] | None = None

    async def read(self, until: int) -> None:
        """Read chunks until `until` tokens came."""
        async with asyncio.timeout(WAIT_S):
            while len(self.tokens) < until:
                self._take(await anext(self.chunks))

    async def read_to_end(self) -> None:
        async for chunk in self.chunks:
            self._take(chunk)

    def read_in_task(self) -> None:
        self.task = asyncio.create_task(self.read_to_end())

    async def cancel_task(self) -> None:
        assert self.task is not None and not self.task.done()
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task

    def _take(self, chunk: GenerateChunk) -> None:
        for choice in chunk.choices:
            self.tokens.extend(choice.token_ids)
            self.finish_reason = choice.finish_reason or self.finish_reason


# -- the undisturbed relay --


async def test_relayed_run_gives_the_model_tokens_and_releases_the_lease(
    cluster: Cluster,
    rid: str,
) -> None:
    p, d = await cluster.start("prefill", "p0"), await cluster.start("decode", "d0")
    router = await cluster.make_router(p, d)
    out = await complete(router, PROMPT, params(), request_id=rid)
    (choice,) = out.choices
    assert choice.token_ids == EXPECTED
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS
    assert decisions(router, "disaggregated") == 1
    ps, ds = await cluster.assert_whole(p, d)
    assert ps.called("prefill") == [rid]
    assert ps.bound_to == ("d0",)  # only the decode worker the router picked may pull it
    assert ps.released == ((rid, True),)  # released at D's first output
    assert ds.handles == (rid,) and ds.peers == ("p0",)
    assert ds.called("abort") == [] and ds.forgotten == ()
    await router.registry.refresh()  # the fakes answer the registry's poll, empty
    assert all(
        w.stats is not None and w.stats.num_running == 0 and w.stats.num_leases == 0
        for w in router.registry.workers.values()
    )


async def test_finished_at_first_token_needs_no_decode(cluster: Cluster, rid: str) -> None:
    p, d = await cluster.start("prefill", "p0"), await cluster.start("decode", "d0")
    router = await cluster.make_router(p, d)
    out = await complete(router, PROMPT, params(max_tokens=1), request_id=rid)
    assert out.choices[0].token_ids == EXPECTED[:1]
    assert out.choices[0].finish_reason == "length"
    _, ds = await cluster.assert_whole(p, d)
    assert ds.calls == ()


async def test_n2_samples_relay_each_under_its_own_id(cluster: Cluster, rid: str) -> None:
    p, d = await cluster.start("prefill", "p0"), await cluster.start("decode", "d0")
    router = await cluster.make_router(p, d)
    out = await complete(router, PROMPT, params(n=2, seed=7), request_id=rid)
    assert [c.index for c in out.choices] == [0, 1]
    for index, choice in enumerate(out.choices):
        assert choice.token_ids == model_tokens(PROMPT, MAX_TOKENS, seed=7 + index)
        assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 2 * MAX_TOKENS
    ids = [sample_request_id(rid, i, 2) for i in range(2)]
    # Both relayed: the first sample's pick does not count the prompt as cached at D already.
    assert decisions(router, "disaggregated") == 2
    ps, ds = await cluster.assert_whole(p, d)
    assert sorted(ps.called("prefill")) == ids
    assert sorted(ps.released) == [(sid, True) for sid in ids]
    assert sorted(ds.handles) == ids


# -- KV faults between prefill and decode --


async def test_lease_lost_before_the_pull_recomputes_on_decode(cluster: Cluster, rid: str) -> None:
    p = await cluster.start("prefill", "p0", lease_expires=True)
    d = await cluster.start("decode", "d0")
    router = await cluster.make_router(p, d, kv_transfer_failure="recompute")
    out = await complete(router, PROMPT, params(), request_id=rid)
    assert out.choices[0].token_ids == EXPECTED
    assert out.choices[0].finish_reason == "length"
    assert router.metrics.leases_lost._value.get() == 1
    ps, ds = await cluster.assert_whole(p, d)
    assert ps.released == ((rid, False),)
    assert ds.forgotten == (rid,)
    # D's relayed stream is dropped and its possibly wrong blocks forgotten before it recomputes.
    assert ds.calls_for(rid) == ["start", "abort", "forget_kv", "start"]


async def test_lease_lost_with_fail_policy_fails_the_request(cluster: Cluster, rid: str) -> None:
    p = await cluster.start("prefill", "p0", lease_expires=True)
    d = await cluster.start("decode", "d0")
    router = await cluster.make_router(p, d, kv_transfer_failure="fail")
    with pytest.raises(UnavailableError, match=KV_TRANSFER_FAILED):
        await complete(router, PROMPT, params(), request_id=rid)
    assert router.metrics.leases_lost._value.get() == 1
    _, ds = await cluster.assert_whole(p, d)
    assert ds.forgotten == (rid,)
    assert ds.calls_for(rid) == ["start", "abort", "forget_kv"]  # dropped, not recomputed


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_pull_failure_at_decode(cluster: Cluster, rid: str, policy: str) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0", pull_fails=True, pull_failure=policy)
    router = await cluster.make_router(p, d, kv_transfer_failure=policy)
    out = await complete(router, PROMPT, params(), request_id=rid)
    (choice,) = out.choices
    if policy == "recompute":  # the decode worker's stream restarts at position 0
        assert choice.token_ids == EXPECTED
        assert choice.finish_reason == "length"
    else:
        assert choice.token_ids == EXPECTED[:1]  # the prefill's token, then the failure
        assert choice.finish_reason == "abort"
        assert str(choice.stop_reason).startswith(KV_TRANSFER_FAILED)
    ps, ds = await cluster.assert_whole(p, d)
    assert ds.pull_failures == 1
    assert ps.released == ((rid, True),)


# -- workers that die --


@pytest.mark.parametrize("fallback", ["second_prefill", "decode_only"])
async def test_prefill_worker_dies_before_the_first_token(
    cluster: Cluster, rid: str, fallback: str
) -> None:
    prefills = [await cluster.start("prefill", "p0", prefill_s=SLOW_S)]
    if fallback == "second_prefill":
        prefills.append(await cluster.start("prefill", "p1", prefill_s=SLOW_S))
    d = await cluster.start("decode", "d0")
    router = await cluster.make_router(*prefills, d)
    task = asyncio.create_task(complete(router, PROMPT, params(), request_id=rid))

    async def prefilling() -> list[bool]:
        return [await live_at(p, rid) for p in prefills]

    await eventually(lambda: _any(prefilling()), "the prefill to start")
    busy = await prefilling()
    victim = prefills[busy.index(True)]
    survivors = [p for p in prefills if p is not victim]
    for p in survivors:
        await p.configure.remote(prefill_s=0.01)
    victim_id = (await victim.state.remote()).engine_id
    cluster.kill(victim)
    async with asyncio.timeout(WAIT_S):
        out = await task
    assert out.choices[0].token_ids == EXPECTED
    assert out.choices[0].finish_reason == "length"
    assert victim_id not in router.registry.workers
    states = await cluster.assert_whole(*survivors, d)
    if fallback == "second_prefill":  # relayed again, through the other prefill worker
        assert states[0].called("prefill") == [rid]
        assert states[1].handles == (rid,)
        assert decisions(router, "disaggregated") == 2
    else:
        assert states[0].handles == ()  # run whole on the decode worker
        assert decisions(router, "decode_only") == 1


async def _any(flags: Awaitable[list[bool]]) -> bool:
    return any(await flags)


@pytest.mark.parametrize("when", ["during_pull", "mid_decode"])
async def test_a_decode_worker_dying_mid_stream_hands_the_sample_on(
    cluster: Cluster, rid: str, when: str
) -> None:
    p = await cluster.start("prefill", "p0")
    slow = {"pull_s": SLOW_S} if when == "during_pull" else {"step_s": SLOW_S}
    d = await cluster.start("decode", "d0", **slow)
    router = await cluster.make_router(p, d)
    client = Client(router, rid)
    await client.read(until=1)  # the prefill's token reached the client
    assert client.tokens == EXPECTED[:1]
    spare = await cluster.start("decode", "d1")  # joins once d0 has the sample
    await router.registry.add(spare)
    if when == "mid_decode":  # D's first output came: the relay released P's lease
        await eventually(lambda: _released(p), "the lease's release")
    cluster.kill(d)
    async with asyncio.timeout(WAIT_S):
        await client.read_to_end()
    # No gap, no repeat: the spare resumed after the token the client had.
    assert client.tokens == EXPECTED
    assert client.finish_reason == "length"
    assert "d0" not in router.registry.workers
    _, spare_state = await cluster.assert_whole(p, spare)
    assert spare_state.resumed == ((rid, (EXPECTED[0],)),)
    assert router.metrics.migrations.labels("resumed")._value.get() == 1


async def test_with_no_worker_to_take_over_the_client_gets_a_clear_error(
    cluster: Cluster, rid: str
) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0", step_s=SLOW_S)
    router = await cluster.make_router(p, d, migration_wait_s=0.5)
    client = Client(router, rid)
    await client.read(until=1)
    cluster.kill(d)
    with pytest.raises(UnavailableError, match="no other could take it over") as info:
        async with asyncio.timeout(WAIT_S):
            await client.read_to_end()
    assert "d0" not in info.value.message  # nothing about the workers reaches the client
    assert "d0" not in router.registry.workers
    (ps,) = await cluster.assert_whole(p)
    assert ps.released == ((rid, True),) or ps.released == ()


async def _released(actor: Any) -> bool:
    state: FakeState = await actor.state.remote()
    return bool(state.released)


# -- the client leaves --


async def test_client_cancels_during_the_prefill(cluster: Cluster, rid: str) -> None:
    p = await cluster.start("prefill", "p0", prefill_s=SLOW_S)
    d = await cluster.start("decode", "d0")
    router = await cluster.make_router(p, d)
    client = Client(router, rid)
    client.read_in_task()
    await eventually(lambda: live_at(p, rid), "the prefill to start")
    await client.cancel_task()
    ps, ds = await cluster.assert_whole(p, d)
    assert ps.called("abort") == [rid]
    assert ds.calls == ()
    assert client.tokens == []


@pytest.mark.parametrize("how", ["aclose", "cancel"])
@pytest.mark.parametrize("stage", ["before_decode_output", "mid_decode"])
async def test_client_leaves_after_the_first_token(
    cluster: Cluster, rid: str, stage: str, how: str
) -> None:
    p = await cluster.start("prefill", "p0")
    slow = {"pull_s": SLOW_S} if stage == "before_decode_output" else {"step_s": 0.2}
    d = await cluster.start("decode", "d0", **slow)
    router = await cluster.make_router(p, d)
    client = Client(router, rid)
    until = 1 if stage == "before_decode_output" else 3  # the prefill's token, or D's too
    if how == "aclose":
        await client.read(until)
        await client.chunks.aclose()  # type: ignore[attr-defined]
    else:
        client.read_in_task()

        async def enough() -> bool:
            return len(client.tokens) >= until

        await eventually(enough, f"{until} tokens")
        await client.cancel_task()
    assert client.tokens == EXPECTED[: len(client.tokens)]
    assert len(client.tokens) < MAX_TOKENS
    # Whole at once if the decode's start had not answered yet: the abort follows its answer.
    await eventually(lambda: aborted_at(d, rid), "the abort at the decode worker")
    ps, ds = await cluster.assert_whole(p, d)
    assert ps.released == ((rid, True),)  # on the way out, or at D's first output
    assert ds.called("abort") == [rid]


async def test_client_leaves_while_the_decode_start_is_on_its_way(
    cluster: Cluster, rid: str
) -> None:
    """The abort waits for the start's answer: sent at once, it would reach the worker before
    the request does, find nothing, and the request would run on (here: hold its blocks for
    the whole slow pull)."""
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0", start_s=1.0, pull_s=SLOW_S)
    router = await cluster.make_router(p, d)
    client = Client(router, rid)
    await client.read(1)  # the prefill's token; the router is now starting the decode
    await client.chunks.aclose()  # type: ignore[attr-defined]
    await eventually(lambda: aborted_at(d, rid), "the abort at the decode worker")
    ps, ds = await cluster.assert_whole(p, d)
    assert ds.calls == (("start", rid), ("abort", rid))
    assert ps.released == ((rid, True),)
