"""Cache-aware routing for real: two colocated workers, prompts sharing long prefixes. The
scoring policy sends each prefix back to the worker that holds it (prefix-cache hits every
time); round-robin, the baseline, alternates and misses."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.models.tokenizer import load_tokenizer
from kvrelay.router.policy import RoutingPolicy
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.types import GenerateRequest, Usage
from kvrelay.router.workers import WorkerRegistry
from kvrelay.worker.pools import Pools

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFIXES = [
    "You are a careful assistant who answers questions about rivers and their history. " * 3,
    "Here is a recipe collection with breads, soups and cakes from many countries. " * 3,
]


async def usage_of(router: Router, tokenizer: Any, prompt: str) -> Usage:
    ids = list(tokenizer(prompt)["input_ids"])
    request = GenerateRequest(f"r{time.monotonic_ns()}", ids, SamplingParams(max_tokens=2))
    usage = None
    async for chunk in router.generate(request):
        usage = chunk.usage or usage
    assert usage is not None
    return usage


@pytest.mark.parametrize(("policy", "all_hit"), [("score", True), ("round_robin", False)])
async def test_prefix_affinity(default_model_dir: Path, policy: str, all_hit: bool) -> None:
    tokenizer = load_tokenizer(default_model_dir)
    pools = Pools.start(
        str(default_model_dir),
        num_decode=2,
        colocated=True,
        engine_kwargs={"kv_cache_memory": "64MiB", "max_model_len": 1024},
        num_threads=1,
    )
    try:
        registry = WorkerRegistry()
        for worker in pools.workers:
            await registry.add(worker)
        card = ModelCard("m", 1024, int(time.time()))
        router = Router.create(registry, tokenizer, card, policy=RoutingPolicy(policy))
        for prefix in PREFIXES:  # first sight of each prefix: nothing cached anywhere
            assert (await usage_of(router, tokenizer, prefix + "Question 0?")).cached_tokens == 0
        # An order that round-robin's alternation cannot follow by luck.
        order = [0, 0, 1, 1, 0, 1]
        cached = [
            (await usage_of(router, tokenizer, f"{PREFIXES[p]}Question {i}?")).cached_tokens
            for i, p in enumerate(order, start=1)
        ]
        assert all(c >= 32 for c in cached) == all_hit, cached
        if not all_hit:
            assert cached.count(0) >= 2, cached
    finally:
        pools.shutdown()
