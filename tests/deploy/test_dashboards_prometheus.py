"""Every dashboard query on a real Prometheus server scraping `kvrelay serve` under load.

Starts Debian's `prometheus` (installed by `make prometheus`) on a free loopback port with
its own config and storage, scraping every second: the router of the session's
`kvrelay_server` (with the namespace and service labels a ServiceMonitor would add), and an
operator metrics endpoint with planner gauges set. Never touches a system Prometheus.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.deploy.dashboards import queries, substitute
from tests.servers import free_port

pytestmark = pytest.mark.e2e

NAMESPACE, SERVICE = "test", "demo"
RATE = "15s"
# Panels that must show data after a little load (latency and throughput).
MUST_HAVE_DATA = {
    "Request rate by outcome",
    "Token throughput",
    "Time to first token",
    "Inter-token latency",
    "End-to-end request latency",
    "Running requests per pool",
    "KV cache usage per pool",
    "Pool workers vs planner target",
    "Router load as a gateway sees it",
    "KV cache usage as a gateway sees it",
    "Requests per worker",
    "KV cache usage per worker",
}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Any:
    """The lead's session fixture (tests/conftest.py): `.http_url` of a `kvrelay serve`."""
    try:
        return request.getfixturevalue("kvrelay_server")
    except pytest.FixtureLookupError:
        pytest.skip("the kvrelay_server fixture is not defined yet")


@pytest.fixture(scope="module")
def operator_metrics_port() -> Iterator[int]:
    """The operator's registry served as the operator serves it, planner gauges set."""
    from prometheus_client import start_http_server

    from kvrelay_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    for pool, desired in (("prefill", 2), ("decode", 3)):
        labels = (NAMESPACE, SERVICE, pool)
        metrics.desired_replicas.labels(*labels).set(desired)
        metrics.current_replicas.labels(*labels).set(1)
        metrics.signal.labels(*labels, "ttft").set(0.4)
        metrics.target.labels(*labels, "ttft").set(0.5)
        metrics.decisions.labels(*labels, "up", "AboveTarget").inc()
    port = free_port()
    httpd, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    yield port
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def prometheus(server: Any, operator_metrics_port: int, tmp_path_factory: Any) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run `make prometheus`")
    router = urlparse(server.http_url)
    work: Path = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(
        f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: router
    static_configs:
      - targets: ["{router.hostname}:{router.port}"]
        labels: {{namespace: {NAMESPACE}, service: {SERVICE}-router}}
  - job_name: operator
    honor_labels: true
    static_configs:
      - targets: ["127.0.0.1:{operator_metrics_port}"]
        labels: {{namespace: kvrelay-system}}
"""
    )
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start: {(work / 'prometheus.log').read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _load(http_url: str, requests: int = 16, concurrency: int = 4) -> None:
    """A little bounded load: short completions, a few at a time, with two shared prefixes so
    the prefix cache sees hits."""
    models = httpx.get(f"{http_url}/v1/models", timeout=30).json()
    model = models["data"][0]["id"]
    prefixes = ["The history of the river runs long, ", "A recipe for bread begins with "]

    def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": prefixes[i % 2] * 12 + f"and part {i} says",
            "max_tokens": 8,
            "temperature": 0,
        }
        response = httpx.post(f"{http_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))


def _query(prom: str, path: str, params: dict[str, Any]) -> Any:
    response = httpx.get(f"{prom}{path}", params=params, timeout=30)
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def _finite_values(data: dict[str, Any]) -> list[float]:
    values = []
    for series in data["result"]:
        points = series.get("values") or [series.get("value")]
        values += [float(v) for _, v in points if not math.isnan(float(v))]
    return values


def test_every_dashboard_query_runs_on_prometheus(server: Any, prometheus: str) -> None:
    total = f'sum(kvrelay_requests_total{{namespace="{NAMESPACE}"}})'

    def requests_seen() -> float:
        data = _query(prometheus, "/api/v1/query", {"query": total})
        return float(data["result"][0]["value"][1]) if data["result"] else 0.0

    def router_scrapes() -> int:
        query = 'count_over_time(up{job="router"}[5m])'
        data = _query(prometheus, "/api/v1/query", {"query": query})
        return int(float(data["result"][0]["value"][1])) if data["result"] else 0

    # One request first, so every series exists before the load, then a few scrapes of it:
    # rate() only sees increases between samples, and a fresh Prometheus takes a few seconds
    # to scrape a new target for the first time (the load alone can finish before that).
    _load(server.http_url, requests=1, concurrency=1)
    deadline = time.monotonic() + 60
    while router_scrapes() < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    before = requests_seen()
    start = time.time()
    _load(server.http_url, requests=16)
    deadline = time.monotonic() + 30
    while requests_seen() < before + 16 and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(3)
    end = time.time()

    missing = []
    for query in queries():
        expr = substitute(query.expr, NAMESPACE, SERVICE, RATE)
        _query(prometheus, "/api/v1/query", {"query": expr})  # evaluates without error
        data = _query(
            prometheus,
            "/api/v1/query_range",
            {"query": expr, "start": start, "end": end, "step": "1s"},
        )
        if query.panel in MUST_HAVE_DATA and not _finite_values(data):
            missing.append(f"{query.panel}: {expr}")
    assert missing == [], "panels without data:\n" + "\n".join(missing)
