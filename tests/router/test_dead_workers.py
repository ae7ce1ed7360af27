"""Workers that die under a real router: the dead one leaves routing; a request that streamed
nothing yet is retried elsewhere, one that did fails as UNAVAILABLE; with no worker left,
requests are refused as UNAVAILABLE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.models.tokenizer import load_tokenizer
from kvrelay.router.request_errors import UnavailableError
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.types import GenerateChunk, GenerateRequest
from kvrelay.router.workers import WorkerRegistry
from kvrelay.worker.pools import Pools

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def collect(chunks: AsyncIterator[GenerateChunk]) -> str:
    return "".join([c.text async for chunk in chunks for c in chunk.choices])


async def test_dead_workers_leave_routing(default_model_dir: Path) -> None:
    import ray

    tokenizer = load_tokenizer(default_model_dir)
    pools = Pools.start(
        str(default_model_dir),
        1,
        1,
        engine_kwargs={"kv_cache_memory": "64MiB", "max_model_len": 1024},
        num_threads=1,
    )
    try:
        registry = WorkerRegistry()
        for worker in pools.workers:
            await registry.add(worker)
        card = ModelCard("m", 1024, int(time.time()))
        # Every prompt goes to prefill first; a lost sample waits 1 s for a worker to take over.
        config = RouterConfig(
            max_local_prefill_tokens=0, migration_wait_s=1.0, max_in_flight=4, max_queued=4
        )
        router = Router.create(registry, tokenizer, card, config)

        def request(prompt: str, tokens: int) -> GenerateRequest:
            ids = list(tokenizer(prompt)["input_ids"])
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            return GenerateRequest(f"r{time.monotonic_ns()}", ids, params)

        # The prefill worker dies: the request had streamed nothing, so it is retried, and
        # with no prefill pool left it runs whole on the decode worker.
        ray.kill(pools.prefill_workers[0])
        text = await collect(router.generate(request("The capital of France is", 4)))
        assert text.startswith(" Paris")
        assert registry.roles() == {"decode"}
        decisions = router.metrics.decisions
        assert decisions.labels("decode_only")._value.get() == 1

        # The decode worker dies mid-stream (for good: ray.kill does not restart it) and no
        # worker is left to resume the sample at: after migration_wait_s, UNAVAILABLE.
        stream = router.generate(request("Tell me a long story.", 500))
        first = await anext(stream)
        assert first.choices and first.choices[0].token_ids
        ray.kill(pools.decode_workers[0])
        with pytest.raises(UnavailableError, match="no other could take it over"):
            async for _ in stream:
                pass
        assert registry.roles() == set()

        # Nothing left to serve with: refused at once, and not ready.
        assert not router.is_ready()
        with pytest.raises(UnavailableError, match="no worker"):
            router.admit(request("Hello", 2))
        assert router.admission.in_flight == 0 and router.admission.queued == 0
    finally:
        pools.shutdown()
