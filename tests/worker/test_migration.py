"""Mid-stream migration on real workers (issue 13): a decode worker killed while it streams a
sample; the router resumes the sample at the other decode worker after the tokens the client
already has, and the client's stream ends with exactly the tokens of an undisturbed run (greedy
and seeded), with no gap and no repeat. The survivors' pools are whole afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from kvrelay.common.messages import Role
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.local import complete, local_router
from kvrelay.router.router import Router
from kvrelay.router.types import GenerateRequest, new_request_id
from kvrelay.worker.pools import Pools
from tests.worker.conftest import TINY_ENGINE_KWARGS

PROMPT = list(range(3, 23))
TOKENS = 200  # long enough that the kill lands mid-stream on the tiny model


@pytest.fixture
def pools(worker_ray: None, tiny_llama_dir: Path) -> Iterator[Pools]:
    started = Pools.start(
        str(tiny_llama_dir),
        num_prefill=1,
        num_decode=2,
        transfer_backend="nixl",
        engine_kwargs=TINY_ENGINE_KWARGS,
    )
    yield started
    started.shutdown()


def serving_decode_worker(router: Router) -> Any:
    """The decode worker that holds the one request in flight."""
    busy = [w for w in router.registry.healthy(Role.DECODE) if w.in_flight]
    assert len(busy) == 1
    return busy[0]


async def stream_with_a_kill(router: Router, params: SamplingParams) -> tuple[list[int], str]:
    """Stream one request; kill its decode worker after a few tokens; read on to the end."""
    request = GenerateRequest(new_request_id(), PROMPT, params)
    tokens: list[int] = []
    killed = ""
    finish = None
    async with asyncio.timeout(120):
        async for chunk in router.generate(request):
            for choice in chunk.choices:
                tokens.extend(choice.token_ids)
                finish = choice.finish_reason or finish
            if not killed and len(tokens) >= 3:
                victim = serving_decode_worker(router)
                killed = victim.worker_id
                ray.kill(victim.actor, no_restart=True)
    assert finish == "length"
    return tokens, killed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS),
        SamplingParams(temperature=0.9, seed=11, max_tokens=TOKENS, min_tokens=TOKENS),
    ],
    ids=["greedy", "seeded"],
)
async def test_a_killed_decode_worker_hands_its_stream_on(
    pools: Pools, params: SamplingParams
) -> None:
    router = await local_router(pools.workers, config=RouterConfig(max_local_prefill_tokens=0))
    undisturbed = (await complete(router, PROMPT, params)).choices[0].token_ids
    assert len(undisturbed) == TOKENS
    tokens, killed = await stream_with_a_kill(router, params)
    assert tokens == undisturbed
    assert killed not in router.registry.workers
    assert router.metrics.migrations.labels("resumed")._value.get() == 1
    survivors = [w.actor for w in router.registry.workers.values()]
    assert len(survivors) == 2
    for stats in ray.get([w.stats.remote() for w in survivors]):
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_leases == 0 and stats.num_running == 0


@pytest.fixture
def pair(worker_ray: None, tiny_llama_dir: Path) -> Iterator[Pools]:
    started = Pools.start(
        str(tiny_llama_dir), transfer_backend="nixl", engine_kwargs=TINY_ENGINE_KWARGS
    )
    yield started
    started.shutdown()


async def replacement_of(router: Router, old_worker_id: str, timeout_s: float = 30.0) -> Any:
    """The one healthy decode worker once it is no longer `old_worker_id` (fails after
    `timeout_s`)."""
    async with asyncio.timeout(timeout_s):
        while True:
            healthy = router.registry.healthy(Role.DECODE)
            if len(healthy) == 1 and healthy[0].worker_id != old_worker_id:
                return healthy[0]
            await asyncio.sleep(0.1)


async def test_a_crashed_only_decode_worker_is_replaced_and_its_stream_resumes(
    pair: Pools,
) -> None:
    """One decode worker, crashed mid-stream (Ray restarts it, as after kill -9): the router
    re-adopts the new engine, the stream waits for it and resumes with the undisturbed tokens,
    within 30 s."""
    router = await local_router(pair.workers, config=RouterConfig(max_local_prefill_tokens=0))
    refresh = asyncio.create_task(router.registry.run(interval_s=0.2))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS)
        undisturbed = (await complete(router, PROMPT, params)).choices[0].token_ids
        (old,) = router.registry.healthy(Role.DECODE)
        request = GenerateRequest(new_request_id(), PROMPT, params)
        tokens: list[int] = []
        killed_at = resumed_at = 0.0
        async with asyncio.timeout(60):
            async for chunk in router.generate(request):
                if killed_at and not resumed_at:
                    resumed_at = time.monotonic()
                tokens.extend(t for c in chunk.choices for t in c.token_ids)
                if len(tokens) >= 3 and not killed_at:
                    ray.kill(old.actor, no_restart=False)  # a crash: Ray restarts it
                    killed_at = time.monotonic()
        assert tokens == undisturbed
        assert resumed_at - killed_at < 30  # the bound for a replacement to serve
        # A new engine in the restarted process. On a fast machine the whole stream can be
        # generated before the kill lands; the registry then adopts the restart a refresh later.
        new = await replacement_of(router, old.worker_id)
        assert new.worker_id != old.worker_id
        assert router.is_ready()
        again = await complete(router, PROMPT, params)
        assert again.choices[0].token_ids == undisturbed
    finally:
        refresh.cancel()
        await router.registry.close()
