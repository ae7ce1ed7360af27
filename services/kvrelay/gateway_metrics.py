"""vLLM's metric names on the router's /metrics, so the Gateway API Inference Extension's
endpoint picker (EPP) and vLLM's Grafana dashboards can read kvrelay's load (docs/operations.md,
"Using kvrelay behind the Gateway API Inference Extension").

The router is the endpoint the EPP picks (it serves the OpenAI API; the workers are Ray actors
without HTTP), so its gauges describe the pools behind it. Each vLLM gauge has exactly one
series, labelled `model_name`: the EPP reads the first series of a family that matches its
selector, so the per-worker series live under other names (metrics.py, `kvrelay_worker_*`).
The counters and histograms are the router's own `kvrelay_*` ones re-emitted under vLLM's names
at scrape time: observed once, so the two names can never disagree. This module must not
report a figure kvrelay does not measure (no LoRA info, no cache-config info) and keeps no state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.common.messages import EngineStats

MODEL_LABEL = "model_name"  # vLLM's label; the router's own metrics call it `model`
# Pools whose workers hold a request's KV from its first output token to its last: their use
# is what a new request competes for (a prefill worker's KV is held only until it is pulled).
KV_HOLDING_POOLS = frozenset({"decode", "colocated"})
# Finish reasons vLLM counts in vllm:request_success; kvrelay's "rejected" requests (429 at
# admission) never reached an engine, so vLLM would not count them either.
FINISHED_REASONS = ("stop", "length", "abort", "error")


class WorkerLoad(NamedTuple):
    """One worker's latest stats as the router knows it (router/workers.py `loads`)."""

    worker: str  # its engine id
    pool: str  # "prefill" | "decode" | "colocated"
    serving: bool  # takes new requests (alive, not draining)
    stats: EngineStats


def requests_waiting(loads: Sequence[WorkerLoad], router_queued: float) -> float:
    """Requests queued for admission at this router, plus those waiting in the workers'
    schedulers or for their prompt's KV to arrive (vLLM counts WAITING_FOR_REMOTE_KVS as
    waiting too). Prefilled prompts leased to a decode worker are not counted: each is also
    that worker's pull, or about to be."""
    return router_queued + sum(w.stats.num_waiting + w.stats.num_pulling for w in loads)


def requests_running(loads: Sequence[WorkerLoad]) -> int:
    """Sequences in the workers' running batches (a request runs at its prefill worker, then
    at its decode worker, never at both at once; each of `n` samples counts, as in vLLM)."""
    return sum(w.stats.num_running for w in loads)


def kv_cache_usage(loads: Sequence[WorkerLoad]) -> float:
    """The fraction of KV blocks in use across the serving decode and colocated workers,
    weighted by their sizes (0..1; 0 with none, when /health already says 503)."""
    holding = [w.stats for w in loads if w.serving and w.pool in KV_HOLDING_POOLS]
    total = sum(s.num_blocks for s in holding)
    if total == 0:
        return 0.0
    return sum(s.kv_usage * s.num_blocks for s in holding) / total


class GatewayCollector(Collector):
    """The vLLM-named families, computed from the workers' loads and the router's metrics at
    scrape time.

    `aliases` maps a vLLM base name to the router's metric it re-emits (`label_map` renames
    `model` to `model_name`); `router_queued` reads the router's admission queue."""

    def __init__(
        self,
        model_name: str,
        loads: Callable[[], Sequence[WorkerLoad]],
        router_queued: Callable[[], float],
        aliases: Mapping[str, Collector],
    ) -> None:
        self._model_name = model_name
        self._loads = loads
        self._router_queued = router_queued
        self._aliases = aliases

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: no samples at registration time

    def collect(self) -> Iterator[Metric]:
        loads = list(self._loads())
        yield from self._gauges(loads)
        yield from self._engine_counters(loads)
        for name, source in self._aliases.items():
            for family in source.collect():
                yield renamed(family, name, _vllm_request_outcome)

    def _gauges(self, loads: Sequence[WorkerLoad]) -> Iterator[Metric]:
        usage = kv_cache_usage(loads)
        values = (
            ("vllm:num_requests_running", "Requests in the workers' running batches.",
             requests_running(loads)),
            ("vllm:num_requests_waiting",
             "Requests queued at the router or waiting in the workers' schedulers.",
             requests_waiting(loads, self._router_queued())),
            ("vllm:kv_cache_usage_perc",
             "KV-cache usage of the decode pool (1 means 100 percent).", usage),
            ("vllm:gpu_cache_usage_perc",
             "KV-cache usage of the decode pool (1 means 100 percent); vLLM's older name.", usage),
        )  # fmt: skip
        for name, doc, value in values:
            gauge = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
            gauge.add_metric([self._model_name], value)
            yield gauge

    def _engine_counters(self, loads: Sequence[WorkerLoad]) -> Iterator[Metric]:
        """Cumulative engine counters summed over the workers the router knows now (a worker
        that leaves takes its counts with it; Prometheus' rate() treats that as a reset)."""
        fields = (
            ("vllm:num_preemptions", "Preemptions in the workers.", "num_preemptions"),
            ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.",
             "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", "prefix_cache_hits"),
        )  # fmt: skip
        for name, doc, field in fields:
            counter = CounterMetricFamily(name, doc, labels=[MODEL_LABEL])
            counter.add_metric([self._model_name], sum(getattr(w.stats, field) for w in loads))
            yield counter


def _vllm_request_outcome(labels: dict[str, str]) -> dict[str, str] | None:
    """The router's labels as vLLM names them: `model` -> `model_name`, `outcome` ->
    `finished_reason`; None drops a sample vLLM would not count (a rejected request)."""
    out = dict(labels)
    if "model" in out:
        out[MODEL_LABEL] = out.pop("model")
    if "outcome" in out:
        outcome = out.pop("outcome")
        if outcome not in FINISHED_REASONS:
            return None
        out["finished_reason"] = outcome
    return out


def renamed(
    family: Metric, name: str, relabel: Callable[[dict[str, str]], dict[str, str] | None]
) -> Metric:
    """`family` under base name `name`, each sample's suffix (`_total`, `_bucket`, `_sum`,
    `_count`, `_created`) kept and its labels passed through `relabel` (None drops it)."""
    out = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = relabel(dict(sample.labels))
        if labels is None:
            continue
        suffix = sample.name[len(family.name) :]
        out.samples.append(sample._replace(name=name + suffix, labels=labels))
    return out
