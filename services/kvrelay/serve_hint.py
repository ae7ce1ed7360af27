"""`kvrelay serve`'s one-line hint on a small machine: which of P/D and colocated served faster
when both shared the same few cores, as serve_compare.py measured it (the figures, their CPU
and date are below; docs/benchmarks.md has the run). Pure: it prints nothing and reads no
hardware itself; the caller passes the core count and prints the line."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.common.env import CORE_SHARE

# At or below this many cores P/D's workers split the cores between them (`kvrelay serve`
# gives each worker cores // workers threads; its prefill worker borrows the idle ones, see
# worker/core_share.py) and colocated's one team is stalled by any other process: the case the
# measurement below is about.
SMALL_MACHINE_CORES = 4
DOCS = "docs/benchmarks.md, 'P/D or colocated on a small machine'"


@dataclass(frozen=True)
class ModeMeasurement:
    """Colocated over P/D in one serve_compare run (bf16, `vllm bench serve`, 128 in / 128
    out): output tok/s at each stream count, TTFT p50 at one stream, ITL p99 at the most."""

    where: str  # the CPU and the date, as the results file names them
    tok_s: dict[int, float]  # colocated / P/D output tok/s, by concurrent streams
    ttft_1: float  # colocated / P/D TTFT p50 at 1 stream (< 1: colocated's came sooner)
    itl_p99_top: float  # colocated / P/D ITL p99 at the most streams (> 1: colocated's worse)

    def colocated_wins(self) -> bool:
        """Colocated is the pick when it served more tokens at every stream count measured."""
        return min(self.tok_s.values()) > 1.0

    def colocated_ahead_at(self) -> list[int]:
        """The stream counts at which colocated served more tokens than P/D."""
        return sorted(c for c, r in self.tok_s.items() if r > 1.0)


# benchmarks/results/2026-12-05_serve_compare_epyc_prefill_kernel.md, the 22:39 run (commit
# c55a78b: the C++ prefill attention, colocated's team spinning 1,000 times before it sleeps):
# P/D 83.1 / 227.1 / 402.6 tok/s, colocated 78.0 / 270.9 / 485.9; TTFT p50 @1 101 vs 111 ms;
# ITL p99 @16 48 vs 282 ms. (The 22:27 run had colocated ahead at every count, 1.05-1.21x.)
# Colocated leads at 4 and 16 streams, P/D at 1 and in tail latency.
MEASURED = ModeMeasurement(
    where="bf16 on a 2-core AMD EPYC, Zen 4, no AMX, quiet, 2026-12-05",
    tok_s={1: 78.0 / 83.1, 4: 270.9 / 227.1, 16: 485.9 / 402.6},
    ttft_1=111 / 101,
    itl_p99_top=282 / 48,
)


def _ratios(tok_s: dict[int, float], whose: str) -> str:
    """e.g. "1.10-1.50x P/D's output tok/s at 1/4/16 streams" (one figure when all agree)."""
    low, high = min(tok_s.values()), max(tok_s.values())
    span = f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"
    streams = "/".join(str(c) for c in sorted(tok_s))
    return f"{span} {whose} output tok/s at {streams} streams"


def small_machine_hint(
    cores: int | None,
    colocated: bool,
    shared_threads: int | None = None,
    measured: ModeMeasurement = MEASURED,
) -> str | None:
    """What `kvrelay serve` prints at start on a machine of `cores` cores in the chosen mode:
    the measured pick (on at most SMALL_MACHINE_CORES cores) and, where its workers share the
    cores step by step (worker/core_share.py; `shared_threads`: each one's share), a line
    saying so. None where it has neither to say (the core count unknown included)."""
    lines = []
    if cores is not None and cores <= SMALL_MACHINE_CORES:
        lines.append(_pick_line(cores, colocated, measured))
    if cores is not None and shared_threads is not None:
        lines.append(sharing_line(cores, shared_threads))
    return "\n".join(lines) or None


def sharing_line(cores: int, share: int) -> str:
    """The line for P/D workers that share their cores step by step."""
    return (
        f"kvrelay: cores shared step by step: the prefill worker runs a prompt on all {cores} "
        f"cores while the decode worker has nothing running and no other process runs, on its "
        f"{share} otherwise ({CORE_SHARE.name}=off: {share} each always)"
    )


def _pick_line(cores: int, colocated: bool, measured: ModeMeasurement) -> str:
    """P/D or colocated, as `measured` says, for a machine of `cores` cores."""
    latency = (
        f"colocated's TTFT p50 at 1 stream was {measured.ttft_1:.2f}x P/D's, its ITL p99 "
        f"{measured.itl_p99_top:.1f}x P/D's"
    )
    if measured.colocated_wins():
        served = _ratios(measured.tok_s, "P/D's")
        verdict = f"--colocated served {served}; {latency}"
        advice = "colocated is the pick here" if colocated else "--colocated serves faster here"
    else:
        pd_over_colocated = {c: 1.0 / r for c, r in measured.tok_s.items()}
        served = _ratios(pd_over_colocated, "colocated's")
        verdict = f"P/D served {served}; {latency}"
        advice = _pd_advice(colocated, measured.colocated_ahead_at())
    return f"kvrelay: hint: {cores} cores: {advice}; {verdict} ({measured.where}); see {DOCS}"


def _pd_advice(colocated: bool, colocated_ahead_at: list[int]) -> str:
    """Where P/D served more at some stream count: P/D for latency, and colocated for the
    stream counts where it served more, if any."""
    if not colocated_ahead_at:
        return "P/D (the default) is the pick here" if not colocated else "drop --colocated"
    where = "/".join(map(str, colocated_ahead_at))
    if colocated:
        throughput = f"colocated is the pick for throughput at {where} streams"
        return f"{throughput}, P/D (drop --colocated) for latency"
    return (
        f"P/D (the default) is the pick for latency, --colocated for throughput at {where} streams"
    )
