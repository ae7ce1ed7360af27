"""A router over worker actors this process already holds (from `Pools`, or started by hand):
the way tests, examples and benchmarks send requests through the one relay, without the APIs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.policy import RoutingPolicy
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.types import GenerateChunk, GenerateRequest, collect_chunks
from kvrelay.router.workers import WorkerRegistry


async def local_router(
    workers: Sequence[Any],
    tokenizer: Any = None,
    *,
    config: RouterConfig | None = None,
    policy: RoutingPolicy | None = None,
    model_id: str = "local",
) -> Router:
    """A router over `workers` (EngineWorker actors): each joins a fresh registry, which
    introduces decode workers to prefill workers. `tokenizer` None serves token ids only."""
    registry = WorkerRegistry()
    for worker in workers:
        await registry.add(worker)
    max_model_len = min(state.info.max_model_len for state in registry.workers.values())
    card = ModelCard(model_id, max_model_len, int(time.time()))
    return Router.create(registry, tokenizer, card, config, policy=policy)


async def complete(
    router: Router,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    request_id: str | None = None,
) -> GenerateChunk:
    """Run one request through `router` to its end: every sample's tokens, text and finish in
    one chunk (samples in index order), with the usage."""
    rid = request_id or uuid.uuid4().hex
    request = GenerateRequest(rid, list(prompt_token_ids), params)
    return await collect_chunks(router.generate(request), rid)
