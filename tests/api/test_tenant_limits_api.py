"""Per-key limits through the real HTTP and gRPC APIs on loopback (the real ApiServer and
router over fake workers): keys from --tenant-limits name tenants; requests and tokens per
minute and concurrent sequences answered with 429 and Retry-After; the file re-read without a
restart; every refusal and token counted under the tenant's name in /metrics, never its key."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvrelay.client import AsyncClient
from kvrelay.client.errors import AuthenticationError, OverloadedError
from kvrelay.config import RouterConfig
from kvrelay.router.tenant_limits import RELOAD_POLL_S
from tests.api.tenancy import (
    KEYS,
    PROMPT,
    auth,
    completion,
    fakes,
    keyed_tenants,
    limits_file,
    serve,
)
from tests.worker.conftest import worker_ray

__all__ = ["fakes", "worker_ray"]

OPERATOR_KEY = "sk-operator"


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and line.split("{", 1)[1].startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_requests_per_minute_per_key_with_retry_after_and_metrics(
    fakes: dict[str, Any], tmp_path: Path
) -> None:
    table = keyed_tenants(A={"requests_per_minute": 2})
    path = limits_file(tmp_path / "tenants.json", table)
    async with serve(fakes, tenant_limits=path) as served:
        client = openai.AsyncOpenAI(
            base_url=f"{served.http_url}/v1", api_key=KEYS["A"], max_retries=0
        )
        for _ in range(2):
            await client.completions.create(model="local", prompt=PROMPT, max_tokens=3)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(model="local", prompt=PROMPT, max_tokens=3)
        retry_after = int(refused.value.response.headers["retry-after"])
        assert 55 <= retry_after <= 60  # the first request leaves the window in ~60 s
        assert "'A' is over its requests_per_minute (2)" in refused.value.message
        other = openai.AsyncOpenAI(
            base_url=f"{served.http_url}/v1", api_key=KEYS["B"], max_retries=0
        )
        await other.completions.create(model="local", prompt=PROMPT, max_tokens=3)  # its own
        async with httpx.AsyncClient(base_url=served.http_url) as http:
            text = (await http.get("/metrics")).text
        assert metric(text, "kvrelay_tenant_requests_total", outcome="admitted", tenant="A") == 2
        assert metric(text, "kvrelay_tenant_requests_total", outcome="limited", tenant="A") == 1
        assert (
            metric(text, "kvrelay_tenant_limited_total", limit="requests_per_minute", tenant="A")
            == 1
        )
        assert metric(text, "kvrelay_tenant_tokens_total", kind="prompt", tenant="A") == 10
        assert metric(text, "kvrelay_tenant_tokens_total", kind="generated", tenant="A") == 6
        assert metric(text, "kvrelay_tenant_requests_total", outcome="admitted", tenant="B") == 1
        assert not any(key in text for key in KEYS.values())  # names, never keys
        await served.until(served.idle)


async def test_the_file_is_reloaded_without_a_restart(
    fakes: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "tenants.yaml"
    target.write_text(f"tenants:\n  - name: A\n    key: {KEYS['A']}\n    requests_per_minute: 1\n")
    async with serve(fakes, tenant_limits=str(target)) as served:
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
            ok = await http.post("/v1/completions", json=completion(), headers=auth("A"))
            assert ok.status_code == 200
            limited = await http.post("/v1/completions", json=completion(), headers=auth("A"))
            assert limited.status_code == 429
            assert limited.json()["error"]["type"] == "rate_limit_error"
            # A new limit, and a new key for B, in place.
            target.write_text(
                f"tenants:\n  - name: A\n    key: {KEYS['A']}\n    requests_per_minute: 5\n"
                f"  - name: B\n    key: {KEYS['B']}\n"
            )
            os.utime(target, ns=(1, 10**18))  # a new mtime even within its resolution
            unknown = await http.post("/v1/completions", json=completion(), headers=auth("H"))
            assert unknown.status_code == 401  # H is listed in neither version
            await asyncio.sleep(RELOAD_POLL_S + 0.1)
            ok = await http.post("/v1/completions", json=completion(), headers=auth("A"))
            assert ok.status_code == 200, ok.text
            added = await http.post("/v1/completions", json=completion(), headers=auth("B"))
            assert added.status_code == 200, added.text
        await served.until(served.idle)


async def test_tokens_per_minute_count_generated_tokens(
    fakes: dict[str, Any], tmp_path: Path
) -> None:
    path = limits_file(tmp_path / "t.json", {"default": {"tokens_per_minute": 30}})
    async with serve(fakes, tenant_limits=path) as served:
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
            first = await http.post("/v1/completions", json=completion(20, ignore_eos=True))
            assert first.status_code == 200  # 5 + 20 tokens: under 30 when it started
            second = await http.post("/v1/completions", json=completion(20, ignore_eos=True))
            assert second.status_code == 200  # 25 < 30
            refused = await http.post("/v1/completions", json=completion(2))
            assert refused.status_code == 429  # 50 tokens in the last minute
            assert "tokens_per_minute (30)" in refused.json()["error"]["message"]
            assert 55 <= int(refused.headers["retry-after"]) <= 60
        await served.until(served.idle)


async def test_concurrent_sequences_per_key(fakes: dict[str, Any], tmp_path: Path) -> None:
    table = keyed_tenants(A={"max_concurrent_sequences": 3})
    path = limits_file(tmp_path / "tenants.json", table)
    async with serve(fakes, tenant_limits=path) as served:
        await fakes["d0"].configure.remote(step_s=0.05)
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
            too_many = await http.post(
                "/v1/completions", json=completion(2, n=4), headers=auth("A")
            )
            assert too_many.status_code == 400  # could never run under this key's limit
            assert too_many.json()["error"]["param"] == "n"
            running = asyncio.create_task(
                http.post("/v1/completions", json=completion(40, n=2), headers=auth("A"))
            )
            await served.until(lambda: served.router.admission.tenant_sequences("A") == 2)
            refused = await http.post("/v1/completions", json=completion(2, n=2), headers=auth("A"))
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert "max_concurrent_sequences" in refused.json()["error"]["message"]
            fits = await http.post("/v1/completions", json=completion(2), headers=auth("A"))
            assert fits.status_code == 200
            other = await http.post("/v1/completions", json=completion(2, n=3), headers=auth("B"))
            assert other.status_code == 200  # B's sequences are its own
            assert (await running).status_code == 200
            text = (await http.get("/metrics")).text
        limit = "max_concurrent_sequences"
        assert metric(text, "kvrelay_tenant_limited_total", limit=limit, tenant="A") == 1
        await served.until(served.idle)


async def test_keys_decide_who_gets_in(fakes: dict[str, Any], tmp_path: Path) -> None:
    path = limits_file(tmp_path / "tenants.json", keyed_tenants())
    async with serve(fakes, tenant_limits=path, api_key=OPERATOR_KEY) as served:
        async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
            for headers, status in [
                (auth("A"), 200),
                ({"Authorization": f"Bearer {OPERATOR_KEY}"}, 200),  # the "default" tenant
                ({"Authorization": "Bearer sk-nobody"}, 401),
                ({"Authorization": KEYS["A"]}, 401),  # no scheme
                ({}, 401),
            ]:
                response = await http.post("/v1/completions", json=completion(), headers=headers)
                assert response.status_code == status, (headers, response.text)
            admin = await http.get("/admin/v1/workers", headers=auth("A"))
            assert admin.status_code == 401  # a tenant's key is not the operator's
            operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
            assert (await http.get("/admin/v1/workers", headers=operator)).status_code == 200
        async with AsyncClient(served.grpc_target, api_key=KEYS["B"], max_retries=0) as client:
            result = await client.generate(PROMPT, max_tokens=2)
            assert result.usage is not None and result.usage.completion_tokens == 2
        async with AsyncClient(served.grpc_target, api_key="sk-nobody", max_retries=0) as client:
            with pytest.raises(AuthenticationError, match="API key"):
                await client.generate(PROMPT, max_tokens=2)
        await served.until(served.idle)


async def test_grpc_limits_answer_resource_exhausted_with_retry_after(
    fakes: dict[str, Any], tmp_path: Path
) -> None:
    path = limits_file(tmp_path / "t.json", keyed_tenants(B={"requests_per_minute": 1}))
    async with serve(fakes, tenant_limits=path) as served:
        async with AsyncClient(served.grpc_target, api_key=KEYS["B"], max_retries=0) as client:
            await client.generate(PROMPT, max_tokens=2)
            with pytest.raises(OverloadedError) as refused:
                await client.generate(PROMPT, max_tokens=2)
            assert "requests_per_minute" in str(refused.value)
            assert refused.value.retry_after is not None and 55 <= refused.value.retry_after <= 60
        await served.until(served.idle)


async def test_the_admin_api_needs_the_operator_key_once_tenants_have_keys(
    fakes: dict[str, Any], tmp_path: Path
) -> None:
    path = limits_file(tmp_path / "tenants.json", keyed_tenants())
    async with serve(fakes, tenant_limits=path) as served:  # no --api-key
        http = httpx.AsyncClient(base_url=served.http_url, timeout=30)
        async with http:
            admin = await http.get("/admin/v1/workers", headers=auth("A"))
            assert admin.status_code == 401 and "--api-key" in admin.json()["error"]["message"]
            assert (await http.post("/v1/completions", json=completion())).status_code == 401


def test_no_limits_file_changes_nothing_for_the_default_router() -> None:
    assert RouterConfig().max_in_flight == 256  # sequences now; the default is unchanged
