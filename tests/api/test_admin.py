"""The admin API (api/admin.py) on the real HTTP app, served on loopback by the real ApiServer,
over fake worker actors on the session's Ray cluster: listing and draining workers by pod,
behind the API key, with errors in OpenAI's shape; the drain flag lands in the worker actor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import ray

from kvrelay.api.server import ApiServer, ServerConfig
from kvrelay.common.messages import DrainState, WorkerStatus
from kvrelay.router.local import local_router
from tests.router.fake_worker import FakeWorker
from tests.worker.conftest import worker_ray

__all__ = ["worker_ray"]

KEY = "admin-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REVISION = "0a1b2c3d4e5f"


def fake(role: str, engine_id: str, pod: str) -> Any:
    options = ray.remote(FakeWorker).options(num_cpus=0)
    return options.remote(role, engine_id, revision=REVISION, pod=pod)


@pytest.fixture(scope="module")
def fakes(worker_ray: None) -> Iterator[dict[str, Any]]:
    """A prefill and two decode workers by engine id, shared by the module's tests."""
    workers = {
        "p0": fake("prefill", "p0", "pod-p"),
        "d0": fake("decode", "d0", "pod-a"),
        "d1": fake("decode", "d1", "pod-b"),
    }
    yield workers
    for actor in workers.values():
        ray.kill(actor)


@pytest.fixture
async def admin(
    fakes: dict[str, Any],
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
    """An HTTP client of a router served on loopback over the fakes (reset: none draining)."""
    await asyncio.gather(*(actor.reset.remote() for actor in fakes.values()))
    router = await local_router(list(fakes.values()))
    server = ApiServer(router, ServerConfig(http_port=0, grpc_port=0, api_key=KEY))
    await server.start()
    base = f"http://127.0.0.1:{server.http_port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            yield client, fakes
    finally:
        server.request_stop()
        await server.drain_and_stop()
        await router.registry.close()


def openai_error(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["code"] == status
    return error


async def test_workers_are_listed_with_pod_node_revision_and_state(
    admin: tuple[httpx.AsyncClient, dict[str, Any]],
) -> None:
    client, _ = admin
    response = await client.get("/admin/v1/workers", headers=AUTH)
    assert response.status_code == 200
    body = response.json()
    assert (body["router_generation"], body["serving_generation"]) == ("", REVISION)
    listed = {w["engine_id"]: w for w in body["workers"]}
    assert set(listed) == {"p0", "d0", "d1"}
    assert listed["d0"] == {
        "name": "kvrelay-decode-pod-a",
        "engine_id": "d0",
        "role": "decode",
        "pod": "pod-a",
        "node": "",
        "generation": REVISION,
        "state": "serving",
        "healthy": True,
        "in_flight": 0,
    }


async def test_drain_by_pod_sets_the_flag_in_the_worker(
    admin: tuple[httpx.AsyncClient, dict[str, Any]],
) -> None:
    client, workers = admin
    response = await client.post(
        "/admin/v1/workers/drain", json={"pods": ["pod-a", "pod-gone"]}, headers=AUTH
    )
    assert response.status_code == 202
    assert response.json() == {"draining": ["kvrelay-decode-pod-a"], "unknown_pods": ["pod-gone"]}
    status: WorkerStatus = await workers["d0"].status.remote()
    assert status.state is DrainState.DRAINING  # every router replica polls this
    assert (await workers["d1"].status.remote()).state is DrainState.SERVING
    listed = (await client.get("/admin/v1/workers", headers=AUTH)).json()["workers"]
    states = {w["pod"]: (w["state"], w["in_flight"]) for w in listed}
    assert states == {"pod-p": ("serving", 0), "pod-a": ("draining", 0), "pod-b": ("serving", 0)}
    # Draining again is harmless (the operator retries its POST until it sees the state).
    again = await client.post("/admin/v1/workers/drain", json={"pods": ["pod-a"]}, headers=AUTH)
    assert again.status_code == 202 and again.json()["draining"] == ["kvrelay-decode-pod-a"]


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/admin/v1/workers"), ("POST", "/admin/v1/workers/drain")]
)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
async def test_the_admin_api_needs_the_api_key(
    admin: tuple[httpx.AsyncClient, dict[str, Any]],
    method: str,
    path: str,
    headers: dict[str, str],
) -> None:
    client, workers = admin
    response = await client.request(method, path, json={"pods": ["pod-a"]}, headers=headers)
    error = openai_error(response, 401, "authentication_error")
    assert "API key" in error["message"]
    assert (await workers["d0"].status.remote()).state is DrainState.SERVING


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"pods": []}, "pods"),
        ({"pods": "pod-a"}, "pods"),
        ({"pods": ["pod-a"], "force": True}, "force"),  # unknown fields are refused
        ({}, "pods"),
    ],
)
async def test_a_bad_drain_body_is_a_400_in_openai_shape(
    admin: tuple[httpx.AsyncClient, dict[str, Any]], body: dict[str, Any], param: str
) -> None:
    client, workers = admin
    response = await client.post("/admin/v1/workers/drain", json=body, headers=AUTH)
    error = openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param
    not_json = await client.post(
        "/admin/v1/workers/drain",
        content=b"{pods",
        headers={**AUTH, "Content-Type": "application/json"},
    )
    openai_error(not_json, 400, "invalid_request_error")
    wrong_method = await client.delete("/admin/v1/workers", headers=AUTH)
    openai_error(wrong_method, 405, "invalid_request_error")
    assert (await workers["d0"].status.remote()).state is DrainState.SERVING


async def test_the_operators_own_client_lists_and_drains(
    admin: tuple[httpx.AsyncClient, dict[str, Any]],
) -> None:
    """The contract from the other side: kvrelay_operator's RouterAdmin (what it runs before
    it shrinks a pool) against this router."""
    from kvrelay_operator.router_admin import RouterAdmin

    client, workers = admin
    operator = RouterAdmin(str(client.base_url), api_key=KEY)
    listed = await asyncio.to_thread(operator.workers)
    assert listed is not None
    assert {(w.name, w.pod, w.drained) for w in listed} == {
        ("kvrelay-prefill-pod-p", "pod-p", False),
        ("kvrelay-decode-pod-a", "pod-a", False),
        ("kvrelay-decode-pod-b", "pod-b", False),
    }
    assert await asyncio.to_thread(operator.drain, ["pod-a"])
    listed = await asyncio.to_thread(operator.workers)
    assert listed is not None
    assert {w.pod for w in listed if w.drained} == {"pod-a"}  # draining, nothing in flight
    assert (await workers["d0"].status.remote()).state is DrainState.DRAINING
    wrong_key = RouterAdmin(str(client.base_url), api_key="wrong")
    assert await asyncio.to_thread(wrong_key.workers) is None  # refused (401), logged
