"""The dashboards read only metrics the code exports, and cover what the issue lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.deploy.dashboards import (
    DASHBOARDS,
    Query,
    exported_metric_names,
    metric_base_names,
    queries,
    substitute,
)


def test_there_are_dashboards_with_queries() -> None:
    assert len(DASHBOARDS) == 2
    assert len(queries()) >= 30


@pytest.mark.parametrize("query", queries(), ids=lambda q: f"{q.dashboard}:{q.panel}")
def test_every_metric_in_a_query_is_exported(query: Query) -> None:
    names = metric_base_names(query.expr)
    assert names, "a panel query reads no kvrelay metric"
    assert names <= exported_metric_names(), names - exported_metric_names()


def test_metric_check_catches_a_typo() -> None:
    assert not metric_base_names("rate(kvrelay_time_to_first_tokn_seconds_bucket[5m])") <= (
        exported_metric_names()
    )
    assert not metric_base_names("vllm:num_request_waiting") <= exported_metric_names()
    assert metric_base_names("max(vllm:num_requests_waiting)") == {"vllm:num_requests_waiting"}


# The metrics of the platform contract (docs/architecture.md section 3) and the planner's.
CONTRACT_METRICS = {
    "kvrelay_time_to_first_token_seconds",
    "kvrelay_inter_token_latency_seconds",
    "kvrelay_e2e_request_latency_seconds",
    "kvrelay_request_queue_time_seconds",
    "kvrelay_request_prefill_time_seconds",
    "kvrelay_kv_transfer_time_seconds",
    "kvrelay_request_decode_time_seconds",
    "kvrelay_requests",
    "kvrelay_prompt_tokens",
    "kvrelay_generation_tokens",
    "kvrelay_disaggregation_decisions",
    "kvrelay_router_requests_in_flight",
    "kvrelay_router_requests_queued",
    "kvrelay_num_requests_running",
    "kvrelay_num_requests_waiting",
    "kvrelay_kv_cache_usage_ratio",
    "kvrelay_pool_workers",
    "kvrelay_preemptions",
    "kvrelay_prefix_cache_queries",
    "kvrelay_prefix_cache_hits",
    "kvrelay_kv_transfer_bytes",
    "kvrelay_kv_transfer_failures",
    "kvrelay_planner_desired_replicas",
    "kvrelay_planner_current_replicas",
}


def test_the_dashboards_read_every_contract_metric() -> None:
    read = set().union(*(metric_base_names(q.expr) for q in queries()))
    assert CONTRACT_METRICS - read == set()
    assert exported_metric_names() >= CONTRACT_METRICS


@pytest.mark.parametrize(
    "title",
    [
        "Request rate by outcome",
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Running requests per pool",
        "Waiting requests per pool",
        "KV cache usage per pool",
        "Prefix-cache hit rate per pool",
        "KV transfer throughput",
        "KV transfer latency",
        "KV transfer failures and preemptions",
        "Disaggregation decisions",
        "Pool workers vs planner target",
        "Router load as a gateway sees it",
        "KV cache usage as a gateway sees it",
        "Requests per worker",
        "KV cache usage per worker",
    ],
)
def test_required_panels_exist(title: str) -> None:
    assert title in {q.panel for q in queries()}


def test_latency_panels_show_three_percentiles() -> None:
    for title in ("Time to first token", "Inter-token latency", "End-to-end request latency"):
        exprs = [q.expr for q in queries() if q.panel == title]
        quantiles = sorted(float(re.findall(r"histogram_quantile\(([0-9.]+)", e)[0]) for e in exprs)
        assert quantiles == [0.5, 0.9, 0.99]
        assert all("_bucket" in e and "by (le)" in e for e in exprs)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_variables_are_defined_and_used_consistently(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "kvrelay"}
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(dashboard["panels"])))
    assert used <= variables | {"__rate_interval"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = substitute(target["expr"], "ns", "svc", "1m")
            assert "$" not in expr
            assert expr.count("(") == expr.count(")")
