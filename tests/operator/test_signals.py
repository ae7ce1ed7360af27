"""Router metrics -> SLO signals, on the text the real router registry exposes."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from kvrelay_operator.signals import (
    RouterSample,
    bucket_delta,
    histogram_quantile,
    parse_router_metrics,
    pool_signal,
)
from kvrelay_operator.spec import Autoscaling

TTFT = Autoscaling(enabled=True, metric="ttft", target=0.5, percentile=90)
ITL = Autoscaling(enabled=True, metric="itl", target=0.1, percentile=50)
KV = Autoscaling(enabled=True, metric="kvUsage", target=0.8)


def _router_text(ttfts: list[float], itls: list[float], kv: dict[str, float]) -> str:
    from kvrelay.common.messages import EngineStats
    from kvrelay.metrics import RouterMetrics

    metrics = RouterMetrics()
    for value in ttfts:
        metrics.ttft.labels("m").observe(value)
    for value in itls:
        metrics.itl.labels("m").observe(value)

    def stats(usage: float) -> EngineStats:
        return EngineStats(
            num_running=0,
            num_waiting=0,
            num_free_blocks=0,
            num_blocks=0,
            kv_usage=usage,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=0,
        )

    metrics.watch_pools(lambda: {pool: [stats(u)] for pool, u in kv.items()})
    return generate_latest(metrics.registry).decode()


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, {}, None),
        (0.5, {1.0: 0.0, math.inf: 0.0}, None),
        # 10 observations in (0, 1], interpolated linearly from 0.
        (0.5, {1.0: 10.0, math.inf: 10.0}, 0.5),
        (0.9, {0.1: 5.0, 0.5: 10.0, math.inf: 10.0}, 0.1 + 0.4 * (9 - 5) / 5),
        # A quantile in +Inf is the largest finite bound.
        (0.99, {0.1: 5.0, 0.5: 6.0, math.inf: 10.0}, 0.5),
        (0.5, {0.1: 0.0, 0.2: 10.0, math.inf: 10.0}, 0.15),
    ],
)
def test_histogram_quantile(q: float, buckets: dict[float, float], expected: float | None) -> None:
    got = histogram_quantile(q, buckets)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_quantile_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, {1.0: 1.0})


def test_bucket_delta_and_counter_reset() -> None:
    before = {0.1: 2.0, math.inf: 4.0}
    assert bucket_delta(before, {0.1: 5.0, math.inf: 9.0}) == {0.1: 3.0, math.inf: 5.0}
    # A restarted router starts from zero: everything it shows is new.
    assert bucket_delta(before, {0.1: 1.0, math.inf: 1.0}) == {0.1: 1.0, math.inf: 1.0}


def test_parse_sums_routers_and_averages_kv_usage() -> None:
    a = _router_text([0.05] * 10, [0.02] * 4, {"prefill": 0.2, "decode": 0.6})
    b = _router_text([0.3] * 10, [], {"prefill": 0.4, "decode": 0.8})
    sample = parse_router_metrics([a, b])
    assert sample.ttft[math.inf] == 20
    assert sample.ttft[0.06] == 10  # the first router's ten, below 60 ms
    assert sample.itl[math.inf] == 4
    assert sample.kv_usage["prefill"] == pytest.approx(0.3)
    assert sample.kv_usage["decode"] == pytest.approx(0.7)


def test_latency_signal_is_the_percentile_of_the_last_window() -> None:
    first = parse_router_metrics([_router_text([0.05] * 100, [], {})])
    # In the window: 10 more fast requests and 90 slow ones (2-2.5 s bucket).
    second = parse_router_metrics([_router_text([0.05] * 110 + [2.2] * 90, [], {})])
    p90 = pool_signal("prefill", TTFT, first, second)
    assert p90 is not None and 2.0 < p90 <= 2.5
    # Without the window it is all history, mostly fast: the window matters.
    assert histogram_quantile(0.5, second.ttft) == pytest.approx(0.06, abs=0.02)


def test_signals_without_a_window_or_traffic() -> None:
    sample = parse_router_metrics([_router_text([0.1], [0.01], {"decode": 0.5})])
    assert pool_signal("prefill", TTFT, None, sample) is None  # first tick: no window yet
    assert pool_signal("decode", ITL, sample, sample) == 0.0  # no requests: idle
    assert pool_signal("decode", KV, None, sample) == 0.5  # a gauge needs no window
    assert pool_signal("decode", KV, None, RouterSample()) is None


def test_garbage_is_rejected() -> None:
    with pytest.raises(ValueError):
        parse_router_metrics(["this is { not prometheus"])
