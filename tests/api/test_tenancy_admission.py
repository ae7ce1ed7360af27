"""Admission by cost and fair turns, through the real HTTP and gRPC APIs on loopback (the real
ApiServer and router over fake workers): a request that could never fit is refused at once
naming `n`; a request counts as its sequences; waiting requests run fairly across tenants
(by API key or --tenant-header) and by `priority` within one; and every slot, queue place and
KV block is given back on every path (refusal, cancel while queued, client gone)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx
import openai
import pytest

from kvrelay.client import AsyncClient
from kvrelay.client.errors import InvalidArgumentError
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.admission import Claim, Cost
from kvrelay.router.types import GenerateRequest
from tests.api.tenancy import (
    KEYS,
    PROMPT,
    Served,
    auth,
    completion,
    fakes,
    keyed_tenants,
    limits_file,
    serve,
)
from tests.worker.conftest import worker_ray

__all__ = ["fakes", "worker_ray"]


async def test_n_that_could_never_run_is_refused_at_once_naming_n(
    fakes: dict[str, Any],
) -> None:
    async with serve(fakes, RouterConfig(max_in_flight=64)) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="local", prompt=PROMPT, n=128, max_tokens=4)
        error: Any = refused.value.body
        assert error["param"] == "n" and "--max-in-flight" in error["message"]
        # Fewer sequences, but 8 x (5 + 4000) tokens of KV: more than the pool (4096) holds.
        with pytest.raises(openai.BadRequestError) as too_much_kv:
            await client.completions.create(model="local", prompt=PROMPT, n=8, max_tokens=4000)
        error = too_much_kv.value.body
        assert error["param"] == "n" and "KV cache holds (4096 tokens)" in error["message"]
        # A list of prompts counts every prompt's n.
        with pytest.raises(openai.BadRequestError) as listed:
            await client.completions.create(model="local", prompt=[PROMPT] * 22, n=3)
        error = listed.value.body
        assert error["param"] == "n" and "66 sequences" in error["message"]
        assert served.idle()


async def test_chat_with_n_128_and_no_max_tokens_is_refused_naming_n(
    fakes: dict[str, Any], default_model_dir: Any
) -> None:
    from kvrelay.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    async with serve(fakes, tokenizer=tokenizer) as served:  # max_in_flight 256: KV refuses
        client = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="local", messages=[{"role": "user", "content": "Hi"}], n=128
            )
        error: Any = refused.value.body
        assert error["param"] == "n" and "no max_tokens" in error["message"]
        assert "max_tokens" in error["message"]
        assert served.idle()


async def test_two_requests_of_n_3_fill_max_in_flight_6(fakes: dict[str, Any]) -> None:
    async with serve(fakes, RouterConfig(max_in_flight=6, max_queued=1)) as served:
        await fakes["d0"].configure.remote(step_s=0.05)
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
            running = [
                asyncio.create_task(http.post("/v1/completions", json=completion(20, n=3)))
                for _ in range(2)
            ]
            await served.until(lambda: served.router.admission.in_flight == 6)
            third = asyncio.create_task(http.post("/v1/completions", json=completion(2)))
            await served.until(lambda: served.router.admission.requests_queued == 1)
            assert served.router.admission.requests_in_flight == 2  # 6 sequences, 2 requests
            refused = await http.post("/v1/completions", json=completion(2))
            assert refused.status_code == 429  # the queue's one sequence is taken
            assert int(refused.headers["retry-after"]) >= 1
            for response in await asyncio.gather(*running, third):
                assert response.status_code == 200, response.text
                assert len(response.json()["choices"]) in (1, 3)
        await served.until(served.idle)


async def queue_behind_held_capacity(
    served: Served, sends: list[tuple[str, Any]]
) -> dict[str, str]:
    """Hold the one running slot, queue each `sends` (name, coroutine of a response id) one
    after the other, then free the slot: name -> response id of each once all are done."""
    held = served.router.admission.reserve(Cost(1), Claim("holder"))
    tasks = {}
    for count, (name, send) in enumerate(sends, start=1):
        tasks[name] = asyncio.create_task(send)
        await served.until(served.queued(count))
    held.release()
    return {name: await task for name, task in tasks.items()}


async def test_waiting_requests_run_fairly_across_api_keys(
    fakes: dict[str, Any], tmp_path: Any
) -> None:
    """Capacity held; A, A, A, B queue: they run A, B, A, A (first come: A, A, A, B)."""
    path = limits_file(tmp_path / "tenants.json", keyed_tenants())
    config = RouterConfig(max_in_flight=1, max_queued=10)
    async with serve(fakes, config, tenant_limits=path) as served:
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:

            async def send(tenant: str) -> str:
                response = await http.post(
                    "/v1/completions", json=completion(2), headers=auth(tenant)
                )
                assert response.status_code == 200, response.text
                return str(response.json()["id"])

            names = ["a1", "a2", "a3", "b1"]
            ids = await queue_behind_held_capacity(
                served, [(name, send(name[0].upper())) for name in names]
            )
        assert await served.decode_order(ids) == ["a1", "b1", "a2", "a3"]
        await served.until(served.idle)


async def test_the_tenant_header_names_the_tenant(fakes: dict[str, Any]) -> None:
    config = RouterConfig(max_in_flight=1, max_queued=10)
    async with serve(fakes, config, tenant_header="X-Tenant") as served:
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:

            async def send(tenant: str) -> str:
                headers = {"X-Tenant": tenant}
                response = await http.post("/v1/completions", json=completion(2), headers=headers)
                assert response.status_code == 200, response.text
                return str(response.json()["id"])

            sends = [("x1", send("x")), ("x2", send("x")), ("y1", send("y"))]
            ids = await queue_behind_held_capacity(served, sends)
            bad = await http.post(
                "/v1/completions", json=completion(), headers={"X-Tenant": "t" * 65}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tenant"
        assert await served.decode_order(ids) == ["x1", "y1", "x2"]
        await served.until(served.idle)


async def test_priority_orders_one_tenants_requests_on_http(fakes: dict[str, Any]) -> None:
    async with serve(fakes, RouterConfig(max_in_flight=1, max_queued=10)) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key="x", max_retries=0)

        async def send(priority: int) -> str:
            reply = await client.completions.create(
                model="local", prompt=PROMPT, max_tokens=2, extra_body={"priority": priority}
            )
            return reply.id

        priorities = [5, -2, 3, 0]
        ids = await queue_behind_held_capacity(served, [(f"p{p}", send(p)) for p in priorities])
        assert await served.decode_order(ids) == ["p-2", "p0", "p3", "p5"]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model="local", prompt=PROMPT, max_tokens=2, extra_body={"priority": 2**31}
            )
        assert refused.value.body["param"] == "priority"  # type: ignore[index]
        await served.until(served.idle)


async def test_priority_orders_one_tenants_requests_on_grpc(fakes: dict[str, Any]) -> None:
    async with serve(fakes, RouterConfig(max_in_flight=1, max_queued=10)) as served:
        async with AsyncClient(served.grpc_target, max_retries=0) as client:

            async def send(priority: int) -> str:
                result = await client.generate(PROMPT, max_tokens=2, priority=priority)
                return f"x-{result.request_id}"

            priorities = [7, 1, -5]
            sends = [(f"p{p}", send(p)) for p in priorities]
            ids = await queue_behind_held_capacity(served, sends)
            with pytest.raises(InvalidArgumentError, match="priority"):
                await client.generate(PROMPT, max_tokens=2, priority=2**31)
        assert await served.decode_order(ids) == ["p-5", "p1", "p7"]
        await served.until(served.idle)


async def test_priority_goes_down_to_the_workers(fakes: dict[str, Any]) -> None:
    async with serve(fakes) as served:
        params = SamplingParams(n=2, max_tokens=2)
        request = GenerateRequest("r1", PROMPT, params, tenant="A", priority=-3)
        runs = served.router._sample_runs(request)
        assert [run.request.priority for run in runs] == [-3, -3]


async def test_every_path_gives_back_its_place_and_blocks(
    fakes: dict[str, Any], tmp_path: Any
) -> None:
    path = limits_file(tmp_path / "tenants.json", keyed_tenants())
    config = RouterConfig(max_in_flight=2, max_queued=4)
    async with serve(fakes, config, tenant_limits=path) as served:
        await fakes["d0"].configure.remote(step_s=0.05)
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
            body = completion(200, stream=True, ignore_eos=True)
            streams = []
            for _ in range(2):  # running: each leaves after its first chunk
                stream = http.stream("POST", "/v1/completions", json=body, headers=auth("A"))
                streams.append(stream)
            opened = [await stream.__aenter__() for stream in streams]
            queued = asyncio.create_task(
                http.post("/v1/completions", json=completion(200), headers=auth("B"))
            )
            await served.until(lambda: served.router.admission.requests_queued == 1)
            queued.cancel()  # the client leaves while queued
            await served.until(lambda: served.router.admission.requests_queued == 0)
            refused = await http.post(  # never fits: refused, nothing held
                "/v1/completions", json=completion(2, n=3), headers=auth("B")
            )
            assert refused.status_code == 400
            for response, stream in zip(opened, streams, strict=True):
                async for _ in response.aiter_bytes():
                    break
                await stream.__aexit__(None, None, None)  # the client leaves mid-stream
        await served.until(served.idle)
        await served.until_blocks_free()
    assert set(KEYS) == {"A", "B", "H"}


def test_the_sdk_sends_priority_as_an_int32() -> None:
    from kvrelay.client import Client
    from kvrelay.client.convert import build_request

    def build(priority: object) -> Any:
        return build_request(
            prompt=PROMPT,
            model=None,
            stream=False,
            request_id=None,
            sampling={"max_tokens": 2},
            priority=priority,  # type: ignore[arg-type]
        )

    assert build(-4).priority == -4 and build(2**31 - 1).priority == 2**31 - 1
    with pytest.raises(InvalidArgumentError, match="priority must be an int"):
        build(True)
    with pytest.raises(InvalidArgumentError, match=r"priority must be in \[-2147483648"):
        build(-(2**31) - 1)
    for method in (Client.generate, Client.chat, AsyncClient.generate, AsyncClient.chat):
        assert inspect.signature(method).parameters["priority"].default == 0
