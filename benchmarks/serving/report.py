"""vLLM's result table (same labels, same layout) and the --result-json dictionary."""

from __future__ import annotations

import math
from typing import Any

from .metrics import BenchmarkMetrics, Summary
from .runner import RunResult, RunSettings

_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_table(
    metrics: BenchmarkMetrics,
    run: RunResult,
    settings: RunSettings,
    goodput: bool,
    selected: tuple[str, ...] = ("ttft", "tpot", "itl"),
) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: object, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    if settings.max_concurrency is not None:
        row("Maximum request concurrency:", settings.max_concurrency)
    if not math.isinf(settings.request_rate):
        row("Request rate configured (RPS):", settings.request_rate, ".2f")
    row("Benchmark duration (s):", run.duration, ".2f")
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput, ".2f")
    if goodput:
        row("Request goodput (req/s):", metrics.request_goodput, ".2f")
    row("Output token throughput (tok/s):", metrics.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", metrics.max_concurrent_requests, ".2f")
    row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f")
    for key, name, header in _SECTIONS:
        if key not in selected:
            continue
        summary: Summary = getattr(metrics, key)
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", summary.mean, ".2f")
        row(f"Median {name} (ms):", summary.median, ".2f")
        for p, value in summary.percentiles:
            row(f"P{_p_word(p)} {name} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def result_dict(
    metrics: BenchmarkMetrics, run: RunResult, goodput: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's result keys: totals, throughputs, per-request lists and every summary."""
    records = run.records
    result: dict[str, Any] = {
        **extra,
        "duration": run.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": list(metrics.output_lens),
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.client_queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    for key, _, _ in _SECTIONS:
        summary: Summary = getattr(metrics, key)
        result[f"mean_{key}_ms"] = summary.mean
        result[f"median_{key}_ms"] = summary.median
        result[f"std_{key}_ms"] = summary.std
        for p, value in summary.percentiles:
            result[f"p{_p_word(p)}_{key}_ms"] = value
    return result
