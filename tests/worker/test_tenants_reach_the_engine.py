"""The tenant and its weight travel from the router to the engine's scheduler: real router,
real worker actors on the tiny model (colocated, and prefill -> decode over gRPC), each
noting what its scheduler receives; greedy tokens are those of a request without a tenant."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.engine.request import Request
from kvrelay.router.local import local_router
from kvrelay.router.tenant_limits import TenantBook
from kvrelay.router.types import GenerateRequest, collect_chunks
from kvrelay.worker.actor import EngineWorker
from tests.transfer.plans import SECRET
from tests.worker.conftest import TINY_ENGINE_KWARGS, worker_ray

__all__ = ["worker_ray"]

PROMPT = list(range(3, 23))  # 20 tokens: past max_local_prefill_tokens=0, so P/D


class TenantNotingWorker(EngineWorker):
    """A real worker whose engine's scheduler also notes each sequence's tenant and weight
    as it receives it (queued, or held for its prompt's KV on a decode engine)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[str, tuple[str, float]] = {}
        scheduler = self.engine.scheduler
        add, hold = scheduler.add, scheduler.add_waiting_for_remote_kv

        def note(request: Request) -> None:
            self.seen[request.request_id] = (request.tenant, request.weight)

        def add_noting(request: Request, forks: Any = ()) -> None:
            for sequence in (request, *forks):
                note(sequence)
            add(request, forks)

        def hold_noting(request: Request) -> None:
            note(request)
            hold(request)

        scheduler.add = add_noting  # type: ignore[method-assign]
        scheduler.add_waiting_for_remote_kv = hold_noting  # type: ignore[method-assign]

    def tenants_seen(self) -> dict[str, tuple[str, float]]:
        return dict(self.seen)


def start(tiny_llama_dir: Path, role: str) -> Any:
    args = {"model": str(tiny_llama_dir), **TINY_ENGINE_KWARGS}
    actor: Any = ray.remote(TenantNotingWorker).options(num_cpus=0)
    return actor.remote(args, role, "grpc", 1, None, SECRET)


@pytest.fixture(scope="module")
def workers(worker_ray: None, tiny_llama_dir: Path) -> Iterator[dict[str, Any]]:
    started = {role: start(tiny_llama_dir, role) for role in ("both", "prefill", "decode")}
    yield started
    for actor in started.values():
        ray.kill(actor)


def limits_file(folder: Path) -> TenantBook:
    path = folder / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "team-a", "key": "sk-a", "weight": 2.5}]}))
    return TenantBook(str(path))


async def run(router: Any, rid: str, tenant: str | None, n: int = 1) -> list[list[int]]:
    params = SamplingParams(n=n, temperature=0.0, max_tokens=6, ignore_eos=True)
    request = GenerateRequest(rid, PROMPT, params)
    if tenant is not None:
        request.tenant = tenant
    chunk = await collect_chunks(router.generate(request), rid)
    return [choice.token_ids for choice in chunk.choices]


@pytest.mark.parametrize("layout", ["colocated", "prefill-decode"])
def test_the_tenant_reaches_the_engine_and_leaves_tokens_unchanged(
    workers: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    pd = [workers["prefill"], workers["decode"]]
    serving = [workers["both"]] if layout == "colocated" else pd
    engines = [workers["decode"]] if layout != "colocated" else serving

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        router = await local_router(serving, config=RouterConfig(max_local_prefill_tokens=0))
        router.tenants = limits_file(tmp_path)
        # The tenant's first: its prompt is new, so the prefill worker prefills it (the
        # decode worker may then find it cached and run the plain request whole).
        tenanted = await run(router, f"{layout}-a", "team-a", n=2)
        plain = await run(router, f"{layout}-plain", None)
        return plain, tenanted

    plain, tenanted = asyncio.run(scenario())
    assert tenanted == plain * 2  # greedy: both samples, with or without a tenant, the same
    seen: dict[str, tuple[str, float]] = {}
    for engine in engines:
        seen |= ray.get(engine.tenants_seen.remote())
    assert seen[f"{layout}-a#0"] == seen[f"{layout}-a#1"] == ("team-a", 2.5)
    assert seen[f"{layout}-plain"] == ("default", 1.0)
    if layout == "prefill-decode":  # the prefill engine got them too
        prefilled = ray.get(workers["prefill"].tenants_seen.remote())
        ours = {v for rid, v in prefilled.items() if rid.startswith(f"{layout}-a#")}
        assert ours == {("team-a", 2.5)}
