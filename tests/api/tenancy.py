"""Helpers of the tenancy tests: the real ApiServer on loopback over fake worker actors (a
prefill and a decode worker on the session's Ray cluster), with a router configured per
test, a tenant-limits file, and the order in which requests reached the decode worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from kvrelay.api.server import ApiServer, ServerConfig
from kvrelay.config import RouterConfig
from kvrelay.router.local import local_router
from kvrelay.router.router import Router
from tests.router.fake_worker import FakeWorker

KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b", "H": "sk-tenant-h"}
PROMPT = [11, 12, 13, 14, 15]  # token ids: short enough to run whole on the decode worker


@pytest.fixture(scope="module")
def fakes(worker_ray: None) -> Iterator[dict[str, Any]]:
    options: Any = ray.remote(FakeWorker).options(num_cpus=0)
    workers: dict[str, Any] = {
        "p0": options.remote("prefill", "p0"),
        "d0": options.remote("decode", "d0"),
    }
    yield workers
    for actor in workers.values():
        ray.kill(actor)


@dataclass
class Served:
    server: ApiServer
    router: Router
    fakes: dict[str, Any]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def idle(self) -> bool:
        """Nothing held: no sequence, place, KV token or tenant count at admission."""
        a = self.router.admission
        books = (a.in_flight, a.queued, a.kv_in_use, a.requests_in_flight, a.requests_queued)
        return books == (0, 0, 0, 0, 0) and not a._by_tenant

    async def until(self, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                await asyncio.sleep(0.01)

    async def blocks_in_use(self) -> int:
        states = await asyncio.gather(*(f.state.remote() for f in self.fakes.values()))
        return sum(state.blocks_in_use for state in states)

    def queued(self, count: int) -> Callable[[], bool]:
        return lambda: self.router.admission.requests_queued == count

    async def until_blocks_free(self, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while await self.blocks_in_use():
                await asyncio.sleep(0.05)

    async def decode_order(self, ids: dict[str, str]) -> list[str]:
        """The names of `ids` (name -> response id) in the order their requests reached the
        decode worker (its call log: the order admission granted them)."""
        state = await self.fakes["d0"].state.remote()
        by_request = {rid.split("-", 1)[-1]: name for name, rid in ids.items()}
        order: list[str] = []
        for _, request_id in state.calls:
            for key, name in by_request.items():
                if request_id.startswith(key) and name not in order:
                    order.append(name)
        return order


def limits_file(path: Path, table: dict[str, Any]) -> str:
    path.write_text(json.dumps(table))
    return str(path)


def keyed_tenants(**extra: dict[str, Any]) -> dict[str, Any]:
    """A limits table with the tenants A, B, H by their KEYS (`extra`: more fields each)."""
    return {
        "tenants": [{"name": name, "key": key, **extra.get(name, {})} for name, key in KEYS.items()]
    }


@contextlib.asynccontextmanager
async def serve(
    fakes: dict[str, Any],
    config: RouterConfig | None = None,
    *,
    tokenizer: Any = None,
    **server: Any,
) -> AsyncIterator[Served]:
    """A router over the fakes (reset) served on loopback; ServerConfig's fields by keyword."""
    await asyncio.gather(*(actor.reset.remote() for actor in fakes.values()))
    router = await local_router(list(fakes.values()), tokenizer, config=config)
    api = ApiServer(router, ServerConfig(http_port=0, grpc_port=0, **server))
    await api.start()
    try:
        yield Served(api, router, fakes)
    finally:
        api.request_stop()
        await api.drain_and_stop()
        await router.registry.close()


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def completion(max_tokens: int = 2, **fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **fields}
