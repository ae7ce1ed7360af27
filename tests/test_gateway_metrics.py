"""vLLM's names on the router's /metrics (gateway_metrics.py), read as the gateway's endpoint
picker and Prometheus read them: the text the real router registry exposes, parsed by
prometheus_client's own parser. The served end (a real server under load) is
tests/api/test_gateway_scrape.py."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.common.messages import EngineStats, Role, WorkerInfo
from kvrelay.config import RouterConfig
from kvrelay.gateway_metrics import (
    WorkerLoad,
    kv_cache_usage,
    requests_running,
    requests_waiting,
)
from kvrelay.metrics import RouterMetrics, metric_names
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.workers import WorkerRegistry, WorkerState

MODEL = "org/model-1"
# The model-server protocol's metrics and their types (gateway-api-inference-extension,
# docs/proposals/003-model-server-protocol), under the names the EPP reads by default.
EPP_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)


def stats(
    running: int = 0,
    waiting: int = 0,
    usage: float = 0.0,
    blocks: int = 100,
    pulling: int = 0,
    leases: int = 0,
    **counters: int,
) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=round(blocks * (1 - usage)),
        num_blocks=blocks,
        kv_usage=usage,
        num_preemptions=counters.get("preemptions", 0),
        prompt_tokens=0,
        generation_tokens=0,
        prefix_cache_queries=counters.get("queries", 0),
        prefix_cache_hits=counters.get("hits", 0),
        num_pulling=pulling,
        num_leases=leases,
    )


def families(metrics: RouterMetrics) -> dict[str, Any]:
    """name -> family, as a scraper parses the exposition text."""
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family: Any) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for s in family.samples]


def epp_reads(parsed: dict[str, Any], spec: str) -> float:
    """What the EPP's extractor reads for a spec without label matchers (its default): the
    family's first series (every series' timestamp is absent, so none is "more recent")."""
    return float(parsed[spec].samples[0].value)


def watched(loads: list[WorkerLoad], queued: int = 0) -> RouterMetrics:
    metrics = RouterMetrics()
    metrics.watch_workers(MODEL, lambda: loads)
    metrics.queued.inc(queued)
    return metrics


# -- the load gauges --------------------------------------------------------------------------


def test_each_epp_gauge_is_one_series_labelled_model_name() -> None:
    loads = [
        WorkerLoad("p0", "prefill", True, stats(running=1, waiting=3, usage=0.9)),
        WorkerLoad("d0", "decode", True, stats(running=4, waiting=1, usage=0.2, pulling=2)),
        WorkerLoad("d1", "decode", True, stats(running=2, usage=0.6)),
    ]
    parsed = families(watched(loads, queued=5))
    for name in EPP_GAUGES:
        family = parsed[name]
        assert family.type == "gauge"
        assert [labels for _, labels, _ in samples(family)] == [{"model_name": MODEL}]
    # waiting: 5 at the router + 3 + 1 in schedulers + 2 waiting for their KV.
    assert epp_reads(parsed, "vllm:num_requests_waiting") == 11
    assert epp_reads(parsed, "vllm:num_requests_running") == 7
    # The decode pool's blocks in use: (20 + 60) / 200; the prefill worker's 0.9 is not in it.
    assert epp_reads(parsed, "vllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert epp_reads(parsed, "vllm:gpu_cache_usage_perc") == pytest.approx(0.4)


def test_the_epp_reads_the_aggregate_not_a_worker() -> None:
    """The per-worker series live under other names: were they in the vLLM family, the EPP's
    default spec would read whichever worker came first."""
    loads = [
        WorkerLoad("d0", "decode", True, stats(running=1, usage=0.1)),
        WorkerLoad("d1", "decode", True, stats(running=5, usage=0.7)),
    ]
    parsed = families(watched(loads))
    assert epp_reads(parsed, "vllm:num_requests_running") == 6
    per_worker = samples(parsed["kvrelay_worker_num_requests_running"])
    assert per_worker == [
        ("kvrelay_worker_num_requests_running", {"pool": "decode", "worker": "d0"}, 1),
        ("kvrelay_worker_num_requests_running", {"pool": "decode", "worker": "d1"}, 5),
    ]


def test_kv_usage_is_weighted_by_size_over_serving_decode_capable_workers() -> None:
    big = WorkerLoad("d0", "decode", True, stats(usage=0.5, blocks=300))
    small = WorkerLoad("d1", "decode", True, stats(usage=1.0, blocks=100))
    colocated = WorkerLoad("c0", "colocated", True, stats(usage=0.25, blocks=400))
    draining = WorkerLoad("d2", "decode", False, stats(usage=1.0, blocks=1000))
    prefill = WorkerLoad("p0", "prefill", True, stats(usage=1.0, blocks=1000))
    assert kv_cache_usage([big, small]) == pytest.approx((150 + 100) / 400)
    assert kv_cache_usage([big, colocated]) == pytest.approx((150 + 100) / 700)
    # A draining worker takes no new request; a prefill worker's KV leaves once pulled.
    assert kv_cache_usage([big, draining, prefill]) == pytest.approx(0.5)
    assert kv_cache_usage([prefill]) == 0.0
    assert kv_cache_usage([]) == 0.0


def test_waiting_and_running_count_every_worker_and_the_router_queue() -> None:
    draining = WorkerLoad("d0", "decode", False, stats(running=2, waiting=1))
    leased = WorkerLoad("p0", "prefill", True, stats(running=1, leases=3))
    pulling = WorkerLoad("d1", "decode", True, stats(pulling=3))
    # A draining worker's requests still run; leases are the pulls' other end, not counted.
    assert requests_running([draining, leased, pulling]) == 3
    assert requests_waiting([draining, leased, pulling], router_queued=2) == 2 + 1 + 3
    assert requests_waiting([], router_queued=0) == 0


def test_the_gauges_follow_the_loads_between_scrapes() -> None:
    loads = [WorkerLoad("d0", "decode", True, stats(running=3, usage=0.3))]
    metrics = watched(loads)
    assert epp_reads(families(metrics), "vllm:num_requests_running") == 3
    loads[0] = WorkerLoad("d0", "decode", True, stats(running=0, usage=0.0))
    metrics.queued.inc(4)
    parsed = families(metrics)
    assert epp_reads(parsed, "vllm:num_requests_running") == 0
    assert epp_reads(parsed, "vllm:num_requests_waiting") == 4
    assert epp_reads(parsed, "vllm:kv_cache_usage_perc") == 0


def test_engine_counters_are_summed_over_the_workers() -> None:
    loads = [
        WorkerLoad("p0", "prefill", True, stats(preemptions=1, queries=100, hits=40)),
        WorkerLoad("d0", "decode", True, stats(preemptions=2, queries=30, hits=10)),
    ]
    parsed = families(watched(loads))
    for name, value in (
        ("vllm:num_preemptions", 3),
        ("vllm:prefix_cache_queries", 130),
        ("vllm:prefix_cache_hits", 50),
    ):
        family = parsed[name]
        assert family.type == "counter"
        assert samples(family) == [(f"{name}_total", {"model_name": MODEL}, value)]


def test_no_workers_gives_zeros_not_missing_families() -> None:
    """The EPP logs an error for a family that is missing: every one is there from the start."""
    parsed = families(watched([]))
    for name in EPP_GAUGES:
        assert epp_reads(parsed, name) == 0
    assert samples(parsed["kvrelay_worker_kv_cache_usage_ratio"]) == []


# -- the router's own metrics under vLLM's names ----------------------------------------------


def test_latency_histograms_are_the_routers_under_vllm_names() -> None:
    metrics = watched([])
    for value in (0.03, 0.3, 3.0):
        metrics.ttft.labels(MODEL).observe(value)
        metrics.itl.labels(MODEL).observe(value / 10)
        metrics.e2e.labels(MODEL).observe(value * 10)
        metrics.decode_time.labels(MODEL).observe(value * 5)
    parsed = families(metrics)
    pairs = {
        "vllm:time_to_first_token_seconds": "kvrelay_time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds": "kvrelay_inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds": "kvrelay_inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds": "kvrelay_e2e_request_latency_seconds",
        "vllm:request_decode_time_seconds": "kvrelay_request_decode_time_seconds",
    }
    for vllm_name, own in pairs.items():
        ours, theirs = parsed[own], parsed[vllm_name]
        assert theirs.type == "histogram"
        expected = [
            (name.replace(own, vllm_name), _as_vllm(labels), value)
            for name, labels, value in samples(ours)
        ]
        assert samples(theirs) == expected
        count = [v for n, _, v in samples(theirs) if n == f"{vllm_name}_count"]
        assert count == [3]
        assert {"le", "model_name"} == set().union(
            *(labels for n, labels, _ in samples(theirs) if n.endswith("_bucket"))
        )


def _as_vllm(labels: dict[str, str]) -> dict[str, str]:
    out = dict(labels)
    out["model_name"] = out.pop("model")
    return out


def test_queue_and_prefill_times_are_not_given_vllm_names() -> None:
    """kvrelay's start at the router's admission queue, vLLM's at the engine's: another
    quantity, so no vLLM name (and no figure kvrelay does not measure)."""
    names = metric_names()
    assert "vllm:request_queue_time_seconds" not in names
    assert "vllm:request_prefill_time_seconds" not in names
    assert "vllm:lora_requests_info" not in names  # kvrelay serves no LoRA adapters
    assert "vllm:cache_config_info" not in names


def test_token_counters_and_request_outcomes() -> None:
    metrics = watched([])
    metrics.prompt_tokens.labels(MODEL).inc(120)
    metrics.generation_tokens.labels(MODEL).inc(48)
    for outcome, count in (("stop", 3), ("length", 2), ("abort", 1), ("error", 1)):
        metrics.requests.labels(MODEL, outcome).inc(count)
    metrics.requests.labels(MODEL, "rejected").inc(5)
    parsed = families(metrics)
    assert parsed["vllm:prompt_tokens"].type == "counter"
    assert ("vllm:prompt_tokens_total", {"model_name": MODEL}, 120) in samples(
        parsed["vllm:prompt_tokens"]
    )
    assert ("vllm:generation_tokens_total", {"model_name": MODEL}, 48) in samples(
        parsed["vllm:generation_tokens"]
    )
    success = {
        labels["finished_reason"]: value
        for name, labels, value in samples(parsed["vllm:request_success"])
        if name == "vllm:request_success_total"
    }
    # 429s at admission never reached an engine: vLLM would not count them either.
    assert success == {"stop": 3, "length": 2, "abort": 1, "error": 1}
    # The router's own counter keeps them.
    own = samples(parsed["kvrelay_requests"])
    assert ("kvrelay_requests_total", {"model": MODEL, "outcome": "rejected"}, 5) in own


def test_every_vllm_name_is_listed_and_the_kvrelay_names_stay() -> None:
    names = metric_names()
    vllm = {n for n in names if n.startswith("vllm:")}
    assert vllm == {
        *EPP_GAUGES,
        "vllm:num_preemptions",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
    }
    assert {
        "kvrelay_num_requests_running",
        "kvrelay_num_requests_waiting",
        "kvrelay_kv_cache_usage_ratio",
        "kvrelay_worker_num_requests_running",
        "kvrelay_worker_num_requests_waiting",
        "kvrelay_worker_kv_cache_usage_ratio",
    } <= names


# -- the router's wiring ----------------------------------------------------------------------


def worker_state(
    role: Role, engine_id: str, worker_stats: EngineStats | None, draining: bool = False
) -> WorkerState:
    info = WorkerInfo(role, engine_id, 1, 16, ("m",), 100, 2048)
    return WorkerState(None, info, worker_stats, draining=draining)


def test_registry_loads_name_each_worker_its_pool_and_whether_it_serves() -> None:
    registry = WorkerRegistry()
    registry.workers["p0"] = worker_state(Role.PREFILL, "p0", stats(running=1))
    registry.workers["d0"] = worker_state(Role.DECODE, "d0", stats(usage=0.5), draining=True)
    registry.workers["c0"] = worker_state(Role.BOTH, "c0", stats(waiting=2))
    registry.workers["d1"] = worker_state(Role.DECODE, "d1", None)  # joined, not yet polled
    loads = registry.loads()
    assert [(w.worker, w.pool, w.serving) for w in loads] == [
        ("p0", "prefill", True),
        ("d0", "decode", False),
        ("c0", "colocated", True),
    ]
    assert loads[0].stats.num_running == 1 and loads[2].stats.num_waiting == 2


def test_a_router_exports_the_vllm_names_for_its_model_and_workers() -> None:
    registry = WorkerRegistry()
    registry.workers["d0"] = worker_state(Role.DECODE, "d0", stats(running=2, usage=0.25))
    metrics = RouterMetrics()
    Router.create(registry, None, ModelCard(MODEL, 2048, 0), RouterConfig(), metrics)
    parsed = families(metrics)
    assert samples(parsed["vllm:num_requests_running"]) == [
        ("vllm:num_requests_running", {"model_name": MODEL}, 2)
    ]
    assert epp_reads(parsed, "vllm:kv_cache_usage_perc") == 0.25
    assert samples(parsed["kvrelay_worker_kv_cache_usage_ratio"]) == [
        ("kvrelay_worker_kv_cache_usage_ratio", {"pool": "decode", "worker": "d0"}, 0.25)
    ]
    # A worker that leaves routing leaves the sums at once.
    registry.remove("d0", "test")
    assert epp_reads(families(metrics), "vllm:num_requests_running") == 0
