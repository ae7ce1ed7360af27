"""The router's Prometheus metrics (docs/architecture.md section 3).

Latency histograms and request counters are observed by the router as requests go by; the
per-pool gauges and counters are read from the workers' latest `EngineStats` at scrape time
by `PoolStatsCollector`, so a scrape always shows the pools as they are; so are the per-worker
gauges (`WorkerStatsCollector`) and vLLM's names for a gateway (gateway_metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.common.messages import EngineStats
from kvrelay.gateway_metrics import GatewayCollector, WorkerLoad

# Buckets in seconds, as vLLM uses for its request latencies (TTFT has finer low buckets).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
DECISIONS = ("disaggregated", "decode_only", "colocated")
POOLS = ("prefill", "decode", "colocated")


class RouterMetrics:
    """Every metric the router exports, in its own registry (tests can make several)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def latency(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r)

        self.ttft = latency(
            "kvrelay_time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS
        )
        self.itl = latency(
            "kvrelay_inter_token_latency_seconds", "Gap between output tokens.", _ITL_BUCKETS
        )
        self.e2e = latency(
            "kvrelay_e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS
        )
        self.queue_time = latency(
            "kvrelay_request_queue_time_seconds", "Time waiting for admission.", _REQUEST_BUCKETS
        )
        self.prefill_time = latency(
            "kvrelay_request_prefill_time_seconds",
            "Admission to first token (prefill, on the prefill worker when disaggregated).",
            _REQUEST_BUCKETS,
        )
        self.transfer_time = latency(
            "kvrelay_kv_transfer_time_seconds",
            "First token at the prefill worker to first output of the decode worker "
            "(KV pull included).",
            _ITL_BUCKETS,
        )
        self.decode_time = latency(
            "kvrelay_request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS
        )
        self._add_counters()
        self.in_flight = Gauge(
            "kvrelay_router_requests_in_flight", "Admitted requests running.", registry=r
        )
        self.queued = Gauge(
            "kvrelay_router_requests_queued", "Requests waiting for admission.", registry=r
        )
        for decision in DECISIONS:
            self.decisions.labels(decision)  # export zeros so rate() has a series from the start
        self.tenants = TenantMetrics(r)

    def _add_counters(self) -> None:
        r = self.registry
        self.requests = Counter(
            "kvrelay_requests", "Requests by outcome.", ["model", "outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvrelay_prompt_tokens", "Prompt tokens of finished requests.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "kvrelay_generation_tokens", "Generated tokens.", ["model"], registry=r
        )
        self.decisions = Counter(
            "kvrelay_disaggregation_decisions",
            "Where requests ran: prefill then decode, whole on a decode worker, or colocated.",
            ["decision"],
            registry=r,
        )
        self.leases_lost = Counter(
            "kvrelay_kv_leases_lost",
            "Relayed requests whose prefill KV lease ended before the decode worker's pull did "
            "(the pulled blocks were dropped; the prompt recomputed, or the request failed).",
            registry=r,
        )

        self.migrations = Counter(
            "kvrelay_requests_migrated",
            "Samples whose worker died mid-stream and that went on at another worker after the "
            "tokens already streamed (or retried whole, when none had been).",
            ["outcome"],
            registry=r,
        )

    def watch_pools(self, snapshot: Callable[[], Mapping[str, Sequence[EngineStats]]]) -> None:
        """Export the pools' gauges and counters from `snapshot()`: pool -> its workers'
        latest stats (healthy workers only)."""
        self.registry.register(PoolStatsCollector(snapshot))

    def watch_workers(self, model_name: str, loads: Callable[[], Sequence[WorkerLoad]]) -> None:
        """Export each worker's load (`kvrelay_worker_*`) and the vLLM-named families a
        gateway's endpoint picker and vLLM's dashboards read (gateway_metrics.py), from
        `loads()`: every worker the router knows, with its latest stats."""
        self.registry.register(WorkerStatsCollector(loads))
        self.registry.register(GatewayCollector(model_name, loads, self._queued, self._aliases()))

    def _queued(self) -> float:
        return next(iter(self.queued.collect())).samples[0].value

    def _aliases(self) -> dict[str, Collector]:
        """vLLM's names for the router's metrics that measure the same thing. Not aliased:
        the queue and prefill times (kvrelay's start at the router's admission queue, vLLM's
        at the engine's) and the KV transfer time (vLLM has none)."""
        return {
            "vllm:time_to_first_token_seconds": self.ttft,
            "vllm:inter_token_latency_seconds": self.itl,
            "vllm:time_per_output_token_seconds": self.itl,  # vLLM's name before 0.11
            "vllm:e2e_request_latency_seconds": self.e2e,
            "vllm:request_decode_time_seconds": self.decode_time,
            "vllm:prompt_tokens": self.prompt_tokens,
            "vllm:generation_tokens": self.generation_tokens,
            "vllm:request_success": self.requests,
        }


class PoolStatsCollector(Collector):
    """Per-pool metrics summed (or averaged, for usage) over each pool's workers."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Sequence[EngineStats]]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: no samples at registration time

    def collect(self) -> Iterator[Metric]:
        pools = self._snapshot()

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["pool"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["pool"])

        running = gauge("kvrelay_num_requests_running", "Requests in the running batch.")
        waiting = gauge("kvrelay_num_requests_waiting", "Requests waiting in the scheduler.")
        usage = gauge("kvrelay_kv_cache_usage_ratio", "Fraction of KV blocks in use (mean).")
        workers = gauge("kvrelay_pool_workers", "Healthy workers in the pool.")
        leases = gauge("kvrelay_kv_leases", "Prefilled prompts' KV held for a decode worker.")
        preemptions = counter("kvrelay_preemptions", "Requests preempted.")
        queries = counter("kvrelay_prefix_cache_queries", "Tokens looked up in the prefix cache.")
        hits = counter("kvrelay_prefix_cache_hits", "Tokens found in the prefix cache.")
        kv_bytes = counter("kvrelay_kv_transfer_bytes", "KV bytes pulled from prefill workers.")
        failures = counter(
            "kvrelay_kv_transfer_failures", "KV pulls that failed (recomputed or failed)."
        )
        for pool in POOLS:
            stats = list(pools.get(pool, ()))
            labels = [pool]
            workers.add_metric(labels, len(stats))
            leases.add_metric(labels, sum(s.num_leases for s in stats))
            running.add_metric(labels, sum(s.num_running for s in stats))
            waiting.add_metric(labels, sum(s.num_waiting for s in stats))
            usage.add_metric(labels, sum(s.kv_usage for s in stats) / len(stats) if stats else 0)
            preemptions.add_metric(labels, sum(s.num_preemptions for s in stats))
            queries.add_metric(labels, sum(s.prefix_cache_queries for s in stats))
            hits.add_metric(labels, sum(s.prefix_cache_hits for s in stats))
            kv_bytes.add_metric(labels, sum(s.kv_bytes_pulled for s in stats))
            failures.add_metric(
                labels, sum(s.kv_pull_fallbacks + s.kv_transfer_failures for s in stats)
            )
        yield from (running, waiting, usage, workers, leases, preemptions, queries, hits)
        yield from (kv_bytes, failures)


class WorkerStatsCollector(Collector):
    """Each worker's running and waiting requests and KV usage, labelled `pool` and `worker`
    (its engine id), for dashboards. Waiting counts requests waiting for their prompt's KV
    too, as vllm:num_requests_waiting does."""

    def __init__(self, loads: Callable[[], Sequence[WorkerLoad]]) -> None:
        self._loads = loads

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: no samples at registration time

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "worker"]
        running = GaugeMetricFamily(
            "kvrelay_worker_num_requests_running", "Requests in the worker's running batch.",
            labels=labels,
        )  # fmt: skip
        waiting = GaugeMetricFamily(
            "kvrelay_worker_num_requests_waiting",
            "Requests waiting in the worker's scheduler or for their prompt's KV.",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            "kvrelay_worker_kv_cache_usage_ratio", "Fraction of the worker's KV blocks in use.",
            labels=labels,
        )  # fmt: skip
        for load in self._loads():
            stats, key = load.stats, [load.pool, load.worker]
            running.add_metric(key, stats.num_running)
            waiting.add_metric(key, stats.num_waiting + stats.num_pulling)
            usage.add_metric(key, stats.kv_usage)
        yield from (running, waiting, usage)


def metric_names() -> set[str]:
    """Base names of every metric the router exports (no `_total` / `_bucket` suffixes)."""
    metrics = RouterMetrics()
    metrics.watch_pools(dict)
    metrics.watch_workers("model", list)
    return {family.name for family in metrics.registry.collect()}


class TenantMetrics:
    """Per tenant (router/tenant_limits.py), labelled with the tenant's configured name, never
    its key; tenants not named in --tenant-limits are counted together as "default"."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "kvrelay_tenant_requests",
            "Requests per tenant: admitted, or refused by a per-tenant limit.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.limited = Counter(
            "kvrelay_tenant_limited",
            "Requests refused (429) per tenant and limit: requests_per_minute, "
            "tokens_per_minute or max_concurrent_sequences.",
            ["tenant", "limit"],
            registry=r,
        )
        self.tokens = Counter(
            "kvrelay_tenant_tokens",
            "Tokens per tenant as they happen: prompt (at admission) and generated.",
            ["tenant", "kind"],
            registry=r,
        )
