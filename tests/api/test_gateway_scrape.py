"""The vLLM-named gauges a gateway's endpoint picker scrapes, on a real server under real load:
requests running at the decode worker, then more queued at the router, then gone. Scraped over
HTTP and parsed by prometheus_client's own parser, as Prometheus and the EPP read them. Also:
/metrics (the new series with it) answers without the API key that /v1 requires."""

from __future__ import annotations

import http.client
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.api.http_app import create_http_app
from kvrelay.common.messages import EngineStats, Role, WorkerInfo
from kvrelay.metrics import RouterMetrics
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.workers import WorkerRegistry, WorkerState
from tests.api.metrics import Scrape, pools_idle, scrape, wait_for
from tests.servers import ServerProcess

MAX_IN_FLIGHT, MAX_QUEUED = 4, 2  # the shared server's bounds (tests/conftest.py)
POOLS = ("prefill", "decode", "colocated")


def families(server: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def gauge(current: Scrape, name: str, model: str) -> float:
    return current.value(name, model_name=model)


def open_stream(server: ServerProcess, prompt: str) -> http.client.HTTPConnection:
    """A long streamed completion sent and left unread: it runs (or queues) until closed."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.fixture
def streams(kvrelay_server: ServerProcess) -> Iterator[list[http.client.HTTPConnection]]:
    """Connections a test opens; all closed at the end (the server aborts their requests),
    and the shared server left idle for the next test."""
    opened: list[http.client.HTTPConnection] = []
    yield opened
    for conn in opened:
        conn.close()
    wait_for(kvrelay_server, pools_idle, timeout_s=30)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_epp_gauges_follow_running_and_queued_requests(
    kvrelay_server: ServerProcess, streams: list[http.client.HTTPConnection]
) -> None:
    server, model = kvrelay_server, kvrelay_server.model
    idle = wait_for(server, pools_idle)
    assert pools_idle(idle)
    parsed = families(server)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert parsed[name].type == "gauge"
        assert [(s.labels, s.value) for s in parsed[name].samples] == [({"model_name": model}, 0)]
    assert gauge(idle, "vllm:kv_cache_usage_perc", model) == 0
    aborted_before = idle.value(
        "vllm:request_success_total", model_name=model, finished_reason="abort"
    )

    # As many long requests as the router admits: all four run at the decode worker.
    streams += [open_stream(server, f"Chapter {i}. The lighthouse keeper") for i in range(4)]
    busy = wait_for(server, lambda s: gauge(s, "vllm:num_requests_running", model) == 4)
    assert gauge(busy, "vllm:num_requests_running", model) == MAX_IN_FLIGHT
    assert sum(busy.value("kvrelay_num_requests_running", pool=p) for p in POOLS) == 4
    assert busy.total("kvrelay_worker_num_requests_running", pool="decode") == 4
    usage = gauge(busy, "vllm:kv_cache_usage_perc", model)
    assert 0 < usage <= 1  # their blocks are held at the decode worker
    # One decode worker: the size-weighted mean is its own usage.
    assert usage == pytest.approx(busy.value("kvrelay_kv_cache_usage_ratio", pool="decode"))
    assert gauge(busy, "vllm:gpu_cache_usage_perc", model) == usage

    # Two more wait at the router for a slot.
    streams += [open_stream(server, f"Appendix {i}. The lamp") for i in range(MAX_QUEUED)]
    queued = wait_for(server, lambda s: s.value("kvrelay_router_requests_queued") == MAX_QUEUED)
    waiting = gauge(queued, "vllm:num_requests_waiting", model)
    assert waiting >= MAX_QUEUED
    # One scrape, one snapshot: the router's queue plus every worker's waiting requests.
    assert waiting == MAX_QUEUED + queued.total("kvrelay_worker_num_requests_waiting")
    assert gauge(queued, "vllm:num_requests_running", model) == MAX_IN_FLIGHT

    for conn in streams:
        conn.close()  # the clients go away: running and queued requests are aborted
    done = wait_for(
        server,
        lambda s: (
            pools_idle(s)
            and gauge(s, "vllm:num_requests_waiting", model) == 0
            and gauge(s, "vllm:num_requests_running", model) == 0
        ),
    )
    assert gauge(done, "vllm:num_requests_running", model) == 0
    assert gauge(done, "vllm:num_requests_waiting", model) == 0
    assert gauge(done, "vllm:kv_cache_usage_perc", model) == 0
    aborted = done.value("vllm:request_success_total", model_name=model, finished_reason="abort")
    assert aborted - aborted_before == MAX_IN_FLIGHT + MAX_QUEUED


@pytest.mark.e2e
@pytest.mark.slow
def test_served_tokens_and_latencies_under_vllm_names(kvrelay_server: ServerProcess) -> None:
    server, model = kvrelay_server, kvrelay_server.model
    before = scrape(server)
    body = {"model": model, "prompt": "Name three colours:", "max_tokens": 6, "ignore_eos": True}
    request = urllib.request.Request(
        f"{server.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        usage = json.loads(response.read())["usage"]
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return after.value(name, model_name=model, **labels) - before.value(
            name, model_name=model, **labels
        )

    assert grew("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert grew("vllm:generation_tokens_total") == usage["completion_tokens"] == 6
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    # The same observations as the router's own histograms, bucket by bucket.
    for le in ("0.5", "5.0", "+Inf"):
        assert after.value(
            "vllm:e2e_request_latency_seconds_bucket", model_name=model, le=le
        ) == after.value("kvrelay_e2e_request_latency_seconds_bucket", model=model, le=le)


# -- the API key rule, in process ---------------------------------------------------------------


def _router_with_one_busy_worker() -> Router:
    registry = WorkerRegistry()
    info = WorkerInfo(Role.DECODE, "d0", 1, 16, ("m",), 100, 2048)
    stats = EngineStats(
        num_running=3,
        num_waiting=1,
        num_free_blocks=40,
        num_blocks=100,
        kv_usage=0.6,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
    )
    registry.workers["d0"] = WorkerState(None, info, stats)
    return Router.create(registry, None, ModelCard("m", 2048, 0), metrics=RouterMetrics())


def test_metrics_stay_open_as_the_key_guards_v1() -> None:
    """The EPP's scraper sends no credentials (only a scheme and a path are configurable):
    /metrics, the vLLM names with it, stays open like /health while /v1 needs the key."""
    app = create_http_app(_router_with_one_busy_worker(), api_key="k3y")
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k3y"}).is_success
        reply = client.get("/metrics")
    assert reply.status_code == 200
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
        if sample.labels == {"model_name": "m"}
    }
    assert values["vllm:num_requests_running"] == 3
    assert values["vllm:num_requests_waiting"] == 1
    assert values["vllm:kv_cache_usage_perc"] == pytest.approx(0.6)
