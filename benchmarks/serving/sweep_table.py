"""serve_compare.py's results: each server's points at every concurrency, the Markdown table of
them, and the ratios of kvrelay's best to its peer's best per precision. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .vllm_client import Point

KVRELAY = "kvrelay"
# Whom kvrelay's best is measured against, per precision: the targets (vLLM for bf16
# and fp32, llama.cpp for Q4_1 weights).
PEER_OF = {"float32": "vLLM", "bfloat16": "vLLM", "q4_1": "llama.cpp"}


@dataclass
class ServerResult:
    """One server of the sweep: what it is and what it measured (or why it could not)."""

    name: str
    family: str  # kvrelay, vLLM or llama.cpp
    precision: str  # float32, bfloat16 or q4_1 (weights)
    cores: str  # what it was given, in words
    points: dict[int, Point] = field(default_factory=dict)  # by concurrency
    error: str | None = None

    def best_at(self, concurrency: int) -> float | None:
        point = self.points.get(concurrency)
        return point.output_throughput if point else None

    def ttft_at(self, concurrency: int) -> float | None:
        point = self.points.get(concurrency)
        return point.median_ttft_ms if point else None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "precision": self.precision,
            "cores": self.cores,
            "error": self.error,
            "points": [vars(p) for p in self.points.values()],
        }


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(results: Sequence[ServerResult], concurrencies: Sequence[int]) -> str:
    """One row per server: output tok/s at each concurrency, TTFT p50 at the lowest and the
    highest (the issue's two TTFT targets), ITL p99 at the highest, ok/failed requests over the
    sweep, the cores it kept busy at the highest (CPU s / wall s)."""
    low, top = min(concurrencies), max(concurrencies)
    ttft_at = [low, top] if low != top else [top]
    head = [f"{c} stream{'s' if c > 1 else ''} tok/s" for c in concurrencies]
    head += [f"TTFT p50 @{c} ms" for c in ttft_at]
    head += [f"ITL p99 @{top} ms", "ok/failed", f"cores busy @{top}"]
    rows = [
        "| server | " + " | ".join(head) + " | given |",
        "|---|" + "---:|" * len(head) + "---|",
    ]
    for r in results:
        if r.error is not None and not r.points:
            cells = ["failed"] * len(concurrencies) + ["-"] * (len(head) - len(concurrencies))
        else:
            last = r.points.get(top)
            ok = sum(p.completed for p in r.points.values())
            bad = sum(p.failed for p in r.points.values())
            cells = [_num(r.best_at(c)) for c in concurrencies]
            cells += [_num(r.ttft_at(c), 0) for c in ttft_at]
            cells += [
                _num(last.p99_itl_ms if last else None, 0),
                f"{ok}/{bad}",
                _num(last.cores_busy if last else None, 2),
            ]
        rows.append(f"| {r.name} | " + " | ".join(cells) + f" | {r.cores} |")
    return "\n".join(rows)


def _best(
    results: Sequence[ServerResult], family: str, precision: str, concurrency: int
) -> tuple[float, str] | None:
    """The highest output tok/s of `family` at `precision` and `concurrency`, with its server."""
    candidates = [
        (tput, r.name)
        for r in results
        if r.family == family and r.precision == precision
        if (tput := r.best_at(concurrency)) is not None
    ]
    return max(candidates) if candidates else None


def ratios_table(results: Sequence[ServerResult], concurrencies: Sequence[int]) -> str:
    """Per precision where both sides ran: kvrelay's best output tok/s over its peer's best at
    each concurrency (> 1.00x: kvrelay ahead), and which servers those bests were."""
    head = " | ".join(f"@{c}" for c in concurrencies)
    rows = [
        f"| precision | kvrelay best / peer best | {head} |",
        "|---|---|" + "---:|" * len(concurrencies),
    ]
    for precision, peer in PEER_OF.items():
        cells, names = [], set()
        for c in concurrencies:
            ours, theirs = (_best(results, f, precision, c) for f in (KVRELAY, peer))
            if ours is None or theirs is None:
                cells.append("-")
                continue
            cells.append(f"{ours[0] / theirs[0]:.2f}x")
            names.add(f"{ours[1]} / {theirs[1]}")
        if names:
            rows.append(f"| {precision} | {'; '.join(sorted(names))} | " + " | ".join(cells) + " |")
    if len(rows) == 2:
        return "(no ratio: no peer ran at the precision of a kvrelay server)"
    return "\n".join(rows)


def _fastest_first_token(
    results: Sequence[ServerResult], family: str, precision: str, concurrency: int
) -> tuple[float, str] | None:
    """The lowest TTFT p50 of `family` at `precision` and `concurrency`, with its server."""
    candidates = [
        (ttft, r.name)
        for r in results
        if r.family == family and r.precision == precision
        if (ttft := r.ttft_at(concurrency)) is not None
    ]
    return min(candidates) if candidates else None


def _target_row(
    target: str, ours: tuple[float, str] | None, theirs: tuple[float, str] | None, unit: str
) -> str:
    """One target's row; `ours` / `theirs` are (value, server). Higher wins for tok/s, lower
    for ms; a side that did not run makes the row "not measured", never "met"."""
    if ours is None or theirs is None:
        return f"| {target} | - | - | - | not measured |"
    ratio = ours[0] / theirs[0]
    met = ratio >= 1.0 if unit == "tok/s" else ratio <= 1.0
    digits = 1 if unit == "tok/s" else 0
    return (
        f"| {target} | {ours[0]:.{digits}f} {unit} ({ours[1]}) | {theirs[0]:.{digits}f} {unit} "
        f"({theirs[1]}) | {ratio:.2f}x | {'met' if met else '**missed**'} |"
    )


def targets_table(
    results: Sequence[ServerResult], concurrencies: Sequence[int], precision: str = "bfloat16"
) -> str:
    """Issue 42's targets at `precision`, met or missed per cell: kvrelay's best output tok/s
    >= its peer's best at every concurrency, and kvrelay's lowest TTFT p50 <= the peer's
    lowest at the lowest and the highest concurrency."""
    peer = PEER_OF[precision]
    low, top = min(concurrencies), max(concurrencies)
    rows = [
        f"| target ({precision}) | kvrelay (its best mode) | {peer} | ratio | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for c in concurrencies:
        ours, theirs = (_best(results, f, precision, c) for f in (KVRELAY, peer))
        rows.append(_target_row(f"output tok/s @{c} >= 1.00x", ours, theirs, "tok/s"))
    for c in sorted({low, top}):
        ours, theirs = (_fastest_first_token(results, f, precision, c) for f in (KVRELAY, peer))
        rows.append(_target_row(f"TTFT p50 @{c} <= {peer}'s", ours, theirs, "ms"))
    return "\n".join(rows)
