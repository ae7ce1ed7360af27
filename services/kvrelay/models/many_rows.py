"""Which path a bf16 matmul of many rows (a prefill chunk, a decode batch) takes on this CPU:
kvrelay's blocked kernel below a crossover row count, oneDNN (torch's `F.linear`) from it on,
the crossover measured per weight shape when the model is packed.

The blocked kernel (AVX512-BF16 dot products) streams a decode step's few rows at memory
speed. oneDNN runs bf16 on AMX tiles where the CPU has them, and on an AMX Xeon wins from a
few rows on (vLLM's CPU build, all oneDNN, gave its first token 2.6-2.9x sooner; issue 42).
On an AVX-512 EPYC without AMX the blocked kernel won at every row count measured
(benchmarks/results/2026-12-05_many_rows.md). So each distinct shape is timed both ways at
`ROW_BUCKETS` and takes oneDNN from the smallest count where oneDNN wins there and at every
larger count; `KVRELAY_CPU_MANY_ROWS=blocked|onednn` skips the measurement (the test suite
pins `blocked`, so its token-exact checks do not depend on a timing).

Memory: oneDNN runs on the layer's dense weight, which every `Linear` keeps anyway (its state
dict), so the choice costs no copy. oneDNN's own packed layout would be a third copy, or, in
place of the blocked one, would cost decode steps the one-call decoder stack; we keep one
layout per shape: the blocked copy for the few rows, the dense weight for the many.

This module decides; it must not import the layers (they call it from `Linear.prepack`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial

import torch

from kvrelay.common.env import CPU_MANY_ROWS
from kvrelay.models.cpu_features import cpu_feature_summary
from kvrelay_kernels.cpu_amx import amx_enabled

logger = logging.getLogger(__name__)

MANY_ROWS_ENV = CPU_MANY_ROWS.name
_CHOICES = ("auto", "blocked", "onednn")
NEVER = sys.maxsize  # a crossover no step reaches: the blocked kernel at every row count
ONEDNN_PINNED_FROM = 2  # `onednn`: every step of many rows; one row keeps the blocked kernel
# The row counts a step uses: decode batches (2-64 streams) and prefill chunks (up to 512).
ROW_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
_REPEATS = 3  # timed calls per path, alternating, after one warm-up each
# oneDNN must win by 5%: a tie keeps the blocked kernel, and with it the decoder stack.
_MARGIN = 0.95
# Larger buckets are not timed once one call takes this long (a big model's 512 rows would
# take seconds per shape); the largest timed bucket's winner then holds above it.
_BUCKET_BUDGET_S = 0.02
_NOISE_FACTOR = 1.5  # see `consistent`

Matmul = Callable[[torch.Tensor], object]
TimePair = Callable[[Callable[[], object], Callable[[], object]], tuple[float, float]]

# Per (out, in, threads): the measured crossover, so each shape is timed once per process.
_measured: dict[tuple[int, int, int], int] = {}


def many_rows_choice() -> str:
    """`auto` (measure), `blocked` or `onednn`, from KVRELAY_CPU_MANY_ROWS.

    Raises:
        ValueError: another value.
    """
    return CPU_MANY_ROWS.choice(_CHOICES)


def crossover_rows(timings: Mapping[int, tuple[float, float]], margin: float = _MARGIN) -> int:
    """The fewest rows from which oneDNN takes over: the smallest measured count where oneDNN
    beats the blocked kernel by `margin`, there and at every larger measured count (one lucky
    bucket among losing ones does not count); `NEVER` where it loses at the largest.

    Args:
        timings: per row count, (blocked kernel seconds, oneDNN seconds).
        margin: oneDNN's time must be below `margin` times the blocked kernel's.
    """
    crossover = NEVER
    for rows in sorted(timings, reverse=True):
        blocked_s, onednn_s = timings[rows]
        if onednn_s >= margin * blocked_s:
            break
        crossover = rows
    return crossover


def _time_pair(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """The fastest of `_REPEATS` calls of each, taking turns after one warm-up each (oneDNN
    picks and caches its kernel on the first call). The minimum, not the median: other
    processes on the same cores only ever add time, so the minimum is the steadiest estimate."""
    first()
    second()
    best = [float("inf"), float("inf")]
    for _ in range(_REPEATS):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def measure_crossover(
    in_features: int,
    blocked: Matmul,
    onednn: Matmul,
    buckets: tuple[int, ...] = ROW_BUCKETS,
    time_pair: TimePair = _time_pair,
) -> tuple[int, dict[int, tuple[float, float]]]:
    """Time both paths on random bf16 rows at each bucket, smallest first; timings that are
    not `consistent` are taken again once, and where they still are not, the blocked kernel
    stays (today's path) with a warning.

    Args:
        in_features: the weight's in-features. blocked, onednn: the two paths, `[M, in]` in.
        buckets: the row counts to time. time_pair: times two calls (tests inject one).

    Returns:
        The crossover (`confirmed_crossover`) and the timings it was read from.
    """
    for _ in range(2):
        timings = _time_buckets(in_features, blocked, onednn, buckets, time_pair)
        if consistent(timings):
            return confirmed_crossover(timings, in_features, blocked, onednn, time_pair), timings
    logger.warning(
        "bf16 matmul of %d in-features: timings too noisy to choose (other processes on these "
        "cores?); the blocked kernel at every row count (%s=onednn pins oneDNN)",
        in_features,
        MANY_ROWS_ENV,
    )
    return NEVER, timings


def _time_buckets(
    in_features: int,
    blocked: Matmul,
    onednn: Matmul,
    buckets: tuple[int, ...],
    time_pair: TimePair,
) -> dict[int, tuple[float, float]]:
    timings: dict[int, tuple[float, float]] = {}
    for rows in buckets:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        with torch.inference_mode():
            timings[rows] = time_pair(partial(blocked, x), partial(onednn, x))
        if min(timings[rows]) > _BUCKET_BUDGET_S:
            break
    return timings


def consistent(timings: Mapping[int, tuple[float, float]]) -> bool:
    """Whether neither path took much longer for fewer rows. A matmul's time grows with its
    rows; a bucket slower than the next larger one by half again means another process held
    a core during every timed call there (seen here under a load of 14 on 2 cores), and then
    the other buckets' times cannot be trusted either."""
    rows = sorted(timings)
    return all(
        timings[small][path] <= _NOISE_FACTOR * timings[large][path]
        for path in (0, 1)
        for small, large in itertools.pairwise(rows)
    )


def confirmed_crossover(
    timings: dict[int, tuple[float, float]],
    in_features: int,
    blocked: Matmul,
    onednn: Matmul,
    time_pair: TimePair = _time_pair,
) -> int:
    """`crossover_rows`, with every bucket where oneDNN won timed once more before it counts.

    A process beside us that takes a core in the middle of a blocked-kernel call makes that
    call look slow; the fastest of both rounds is kept (so only a slowdown seen in both
    rounds moves the crossover), and the second round costs time only where oneDNN won.
    `timings` is updated in place.
    """
    crossover = crossover_rows(timings)
    for rows in [r for r in sorted(timings) if r >= crossover]:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        with torch.inference_mode():
            again = time_pair(partial(blocked, x), partial(onednn, x))
        timings[rows] = (min(timings[rows][0], again[0]), min(timings[rows][1], again[1]))
    return crossover_rows(timings)


def onednn_from_rows(weight: torch.Tensor, blocked: Matmul, onednn: Matmul) -> int:
    """The row count from which `weight`'s matmul takes oneDNN; `NEVER` (the blocked kernel
    at every count) for weights other than bf16 and under `KVRELAY_CPU_MANY_ROWS=blocked`.

    Args:
        weight: `[out, in]`, the layer's dense weight.
        blocked, onednn: the layer's two paths, `[M, in]` in, for `auto` to time.
    """
    choice = many_rows_choice()
    if weight.dtype != torch.bfloat16 or choice == "blocked":
        return NEVER
    log_cpu_features()
    if choice == "onednn":
        return ONEDNN_PINNED_FROM
    key = (weight.shape[0], weight.shape[1], torch.get_num_threads())
    if key not in _measured:
        amx_enabled()  # before oneDNN is timed: its tiles need the process's permission
        crossover, timings = measure_crossover(weight.shape[1], blocked, onednn)
        _measured[key] = crossover
        logger.info("bf16 matmul %s: %s", list(weight.shape), describe(crossover, timings))
    return _measured[key]


@functools.cache
def log_cpu_features() -> str:
    """Log, once per process, the CPU line that decides the bf16 paths (AMX asked for where
    the CPU has it: `cpu_features.cpu_feature_summary`); returns it."""
    summary = cpu_feature_summary()
    logger.info("CPU %s", summary)
    return summary


def describe(crossover: int, timings: Mapping[int, tuple[float, float]]) -> str:
    """One line for the log: the choice, and the times at the largest bucket measured."""
    rows = max(timings)
    blocked_us, onednn_us = (1e6 * s for s in timings[rows])
    where = "blocked kernel at every row count" if crossover == NEVER else (
        f"oneDNN from {crossover} rows, blocked kernel below")  # fmt: skip
    return f"{where} ({rows} rows: blocked {blocked_us:.0f} us, oneDNN {onednn_us:.0f} us)"
