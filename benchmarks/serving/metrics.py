"""The summary maths of a serving run, defined as `vllm bench serve` defines them.

TTFT, TPOT = (latency - ttft) / (output_len - 1) for requests of more than one token, ITL (every
inter-chunk gap of every request, pooled), E2E latency; request / output / total token
throughput over the run's wall time; goodput = requests meeting every SLO per second (a
one-token request counts its TPOT as 0 there). Mean, median, population std and percentiles
(numpy's linear interpolation) of each; an empty list summarises as 0. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .records import RequestRecord

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Summary:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]  # (p, value)

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Summary:
        # vLLM summarises an empty list (e.g. no request had 2+ tokens) as 0, not NaN.
        values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean=float(np.mean(values)),
            median=float(np.median(values)),
            std=float(np.std(values)),
            percentiles=tuple((p, float(np.percentile(values, p))) for p in percentiles),
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary
    output_lens: tuple[int, ...]  # per request, 0 for failed ones


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    Raises:
        ValueError: a pair is not NAME:MS, the name is unknown, or the value is negative.
    """
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or math.isnan(ms):
            raise ValueError(f"goodput SLOs are NAME:MILLISECONDS pairs, got {pair!r}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput metric must be one of {GOODPUT_METRICS}, got {name!r}")
        if ms < 0:
            raise ValueError(f"goodput SLO must be >= 0 ms, got {pair!r}")
        slos[name] = ms
    return slos


def calculate_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float],
    goodput_slos: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Summarise a run of `duration` seconds. `goodput_slos` are in milliseconds."""
    ok = [r for r in records if r.success]
    output_lens = tuple(r.output_len if r.success else 0 for r in records)
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots: list[float] = []  # only requests with 2+ tokens: what the TPOT statistics use
    tpot_or_zero: list[float] = []  # every request, 0 for 1-token ones: what goodput uses
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
        if r.output_len > 1:
            tpots.append(tpot)
        tpot_or_zero.append(tpot)

    good = 0
    if goodput_slos:
        per_metric = {"ttft": ttfts, "tpot": tpot_or_zero, "e2el": e2els}
        checks = [(per_metric[name], ms / 1000.0) for name, ms in goodput_slos.items()]
        good = sum(all(values[i] <= limit for values, limit in checks) for i in range(len(ok)))

    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    peak_tokens, peak_concurrency = _peaks(ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration,
        request_goodput=good / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
        ttft=Summary.of(ttfts, percentiles),
        tpot=Summary.of(tpots, percentiles),
        itl=Summary.of(itls, percentiles),
        e2el=Summary.of(e2els, percentiles),
        output_lens=output_lens,
    )


def _peaks(ok: Sequence[RequestRecord]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket of the run (token i of a request lands at
    start + ttft + sum(itl[:i])), and the peak number of requests in flight at once."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(math.ceil(end - t0) + 1)
    for r in ok:
        times = r.start_time + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        for second in (times - t0).astype(int):
            if 0 <= second < len(buckets):
                buckets[second] += 1
    # Half-open [start, end): a request ending exactly when another starts does not overlap.
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return float(buckets.max()), peak
