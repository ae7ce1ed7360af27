"""Router metrics -> the planner's SLO signals (TTFT and ITL percentiles, KV usage per pool).

The planner scrapes every router pod's `/metrics` on each tick. Latency histograms are
cumulative, so a percentile over the last interval comes from the difference of two
scrapes' buckets, computed the way Prometheus' `histogram_quantile` does. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvrelay_operator.spec import Autoscaling

Buckets = Mapping[float, float]  # upper bound `le` -> cumulative count

_HISTOGRAMS = {
    "kvrelay_time_to_first_token_seconds": "ttft",
    "kvrelay_inter_token_latency_seconds": "itl",
}


@dataclass(frozen=True)
class RouterSample:
    """One scrape of all routers: latency buckets summed over models and routers, and each
    pool's KV usage averaged over routers."""

    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    kv_usage: Mapping[str, float] = field(default_factory=dict)


def parse_router_metrics(texts: Sequence[str]) -> RouterSample:
    """Parse the text exposition of each router pod into one sample.

    Raises:
        ValueError: a text is not Prometheus exposition format.
    """
    buckets: dict[str, dict[float, float]] = {"ttft": {}, "itl": {}}
    usage: dict[str, list[float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name in _HISTOGRAMS:
                target = buckets[_HISTOGRAMS[family.name]]
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        target[le] = target.get(le, 0.0) + s.value
            elif family.name == "kvrelay_kv_cache_usage_ratio":
                for s in family.samples:
                    usage.setdefault(s.labels.get("pool", ""), []).append(s.value)
    return RouterSample(
        ttft=buckets["ttft"],
        itl=buckets["itl"],
        kv_usage={pool: sum(v) / len(v) for pool, v in usage.items()},
    )


def bucket_delta(previous: Buckets, current: Buckets) -> dict[float, float]:
    """Observations between two scrapes. A router that restarted resets its counters; then
    the current counts are all new, as Prometheus' `increase` assumes."""
    if any(current.get(le, 0.0) < count for le, count in previous.items()):
        return dict(current)
    return {le: count - previous.get(le, 0.0) for le, count in current.items()}


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of cumulative `buckets`, interpolated linearly inside a bucket.

    Returns None when the histogram holds no observation. A quantile in the +Inf bucket is
    the largest finite bound, as in Prometheus.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def pool_signal(
    pool: str, auto: Autoscaling, previous: RouterSample | None, current: RouterSample
) -> float | None:
    """The pool's SLO signal over the last interval, in the unit of its target.

    Returns None when there is nothing to judge by (no earlier scrape for a latency
    window, no KV gauge), and 0.0 for a latency window without requests: an idle pool.
    """
    if auto.metric == "kvUsage":
        return current.kv_usage.get(pool)
    if previous is None:
        return None
    name = "ttft" if auto.metric == "ttft" else "itl"
    delta = bucket_delta(getattr(previous, name), getattr(current, name))
    value = histogram_quantile(auto.percentile / 100.0, delta)
    return 0.0 if value is None else value
