"""The decode dispatch's table, made at load (decode_dispatch.py): both decode kernels timed on
the engine's own KV cache at `BATCH_BUCKETS` x `CONTEXT_BUCKETS`, or the kernel pinned by
KVRELAY_DECODE_ATTENTION.

The engine calls `prepare` once, before its decode graphs are captured (a graph records the
kernel the table chose), never inside a served step. Timing needs a real CUDA device: on a
torch built without CUDA (the fake-CUDA rig), or off the `cuda` backend, nothing is timed and
the CUDA kernel keeps every step unless a test injects timings (`measure_fn=`); where only
one kernel runs the shape (or a variant), it takes every step untimed.

How it times: the smallest cell first, once per kernel, outside the clock (Triton compiles
its decode variant there, inside the engine's warm-up); then the cells largest first, the two
kernels taking turns `REPEATS` times, each sample a few back-to-back calls between CUDA events,
the median kept; stopped when `BUDGET_S` is spent (the largest cells, where the kernels part,
are timed first; a cell left out reads its nearest neighbour). The queries read the cache's
first blocks in order, wrapping around a small cache: reads, no write, so a cache about to
serve keeps nothing of it. A kernel that raises is left out of the cells it failed on.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from kvrelay_kernels import cuda_backend, triton_backend
from kvrelay_kernels.counters import COUNTERS
from kvrelay_kernels.decode_dispatch import (
    BATCH_BUCKETS,
    CONTEXT_BUCKETS,
    CUDA,
    PIN_CHOICES,
    TRITON,
    DecodeShape,
    DecodeTable,
    Timings,
    choose_table,
    install,
    pinned_table,
    shape_of,
)
from kvrelay_kernels.env import DECODE_ATTENTION

logger = logging.getLogger(__name__)

BUDGET_S = 2.0  # of timing per engine, all shapes together (compiles not counted)
REPEATS = 5  # samples per kernel and cell, taking turns; the median is kept
SAMPLE_S = 1e-4  # a sample runs enough calls to last about this long (launch noise)
MAX_CALLS = 32  # calls per sample at most

Variant = tuple[int | None, float | None]  # (sliding window, soft cap) of some layers


class DecodeCall(Protocol):
    """One kernel's decode: (query [B, heads, dim], tables [B, W] int32, lens [B] int32, the
    longest context, out) -> None."""

    def __call__(
        self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, context: int,
        out: torch.Tensor,
    ) -> object: ...  # fmt: skip


# (the call to time, how many calls) -> seconds for all of them
Timer = Callable[[Callable[[], object], int], float]
# (the shape, the kernels' calls, the cache) -> timings: the whole measurement (tests inject)
Measure = Callable[[DecodeShape, Mapping[str, DecodeCall], torch.Tensor], Timings]


def variants_of(windows: Iterable[int | None], soft_cap: float | None) -> list[Variant]:
    """The distinct (window, cap) pairs of a model's layers (`windows`: one per layer, None
    for full attention; empty: every layer full), each timed apart: a window caps the keys
    read."""
    found = {(w, soft_cap) for w in windows} or {(None, soft_cap)}
    return sorted(found, key=lambda v: (v[0] is not None, v[0] or 0))


def can_time(kv_cache: torch.Tensor) -> bool:
    """Whether decodes on `kv_cache` can be timed here: a CUDA tensor under a torch built with
    CUDA (the fake-CUDA rig's torch is not: its kernels compute and take nothing)."""
    return kv_cache.is_cuda and torch.backends.cuda.is_built()


def supported(kv_cache: torch.Tensor, num_heads: int, variant: Variant) -> dict[str, bool]:
    """Which kernels run decodes of this shape and variant on `kv_cache`."""
    window, cap = variant
    needs = (window is not None, cap is not None)

    def implements(flags: tuple[bool, bool]) -> bool:
        return all(has or not need for has, need in zip(flags, needs, strict=True))

    cuda_flags = (cuda_backend.SLIDING_WINDOW, cuda_backend.SOFT_CAP)
    triton_flags = (triton_backend.SLIDING_WINDOW, triton_backend.SOFT_CAP)
    return {
        CUDA: implements(cuda_flags) and cuda_backend.decode_kernel_runs(kv_cache, num_heads),
        TRITON: implements(triton_flags) and triton_backend.is_available(),
    }


def kernel_calls(
    kv_cache: torch.Tensor, scale: float, variant: Variant, runs: Mapping[str, bool]
) -> dict[str, DecodeCall]:
    """Each runnable kernel's decode over layer 0 of `kv_cache`, with the variant's window
    and cap (the calls the dispatch makes, split-K left to the CUDA kernel)."""
    window, cap = variant
    calls: dict[str, DecodeCall] = {}
    if runs.get(CUDA):

        def cuda(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, context: int,
                 out: torch.Tensor) -> object:  # fmt: skip
            return cuda_backend.decode_attention(
                q, kv_cache, 0, tables, lens, context, scale, out,
                sliding_window=window, soft_cap=cap,
            )  # fmt: skip

        calls[CUDA] = cuda
    if runs.get(TRITON):
        from kvrelay_kernels import triton_attention

        def triton(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, context: int,
                   out: torch.Tensor) -> object:  # fmt: skip
            return triton_attention.decode_attention(
                q, kv_cache, 0, tables, lens, scale, out, sliding_window=window, soft_cap=cap
            )

        calls[TRITON] = triton
    return calls


def cuda_timer(fn: Callable[[], object], calls: int) -> float:
    """Seconds `calls` back-to-back calls of `fn` take on the current stream (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def cell_inputs(
    kv_cache: torch.Tensor, num_heads: int, batch: int, context: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, tables, lens, out) of `batch` decodes of `context` keys on `kv_cache`'s
    device: each sequence on its own blocks, in order, wrapping around the cache."""
    block_size, num_blocks = kv_cache.shape[3], kv_cache.shape[0]
    width = -(-context // block_size)
    device = kv_cache.device
    ids = torch.arange(batch * width, dtype=torch.int64, device=device) % num_blocks
    tables = ids.to(torch.int32).view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    shape = (batch, num_heads, kv_cache.shape[5])
    query = torch.randn(shape, device=device).to(kv_cache.dtype)
    return query, tables, lens, torch.empty_like(query)


def measure(
    shape: DecodeShape,
    calls: Mapping[str, DecodeCall],
    kv_cache: torch.Tensor,
    *,
    timer: Timer = cuda_timer,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[tuple[str, int, int], float]:
    """Seconds per call of each kernel in `calls` at each bucket (see the module's docstring);
    cells past the budget are left out."""
    cells = [(b, c) for b in BATCH_BUCKETS for c in CONTEXT_BUCKETS]
    smallest = min(cells, key=lambda cell: cell[0] * cell[1])
    timings: dict[tuple[str, int, int], float] = {}
    failed: set[str] = set()
    _run_once(shape, calls, kv_cache, smallest, failed)  # compiles, outside the clock
    deadline = clock() + budget_s
    for batch, context in sorted(cells, key=lambda cell: -cell[0] * cell[1]):
        if clock() > deadline:
            logger.info("decode timing: budget of %.1f s spent; nearer cells stand in", budget_s)
            break
        x = cell_inputs(kv_cache, shape.num_heads, batch, context)
        runs = {
            name: _bound(call, x, context) for name, call in calls.items() if name not in failed
        }
        timings.update(_time_cell(runs, batch, context, timer))
    return timings


def _bound(call: DecodeCall, x: tuple[torch.Tensor, ...], context: int) -> Callable[[], object]:
    q, tables, lens, out = x
    return lambda: call(q, tables, lens, context, out)


def _run_once(
    shape: DecodeShape,
    calls: Mapping[str, DecodeCall],
    kv_cache: torch.Tensor,
    cell: tuple[int, int],
    failed: set[str],
) -> None:
    """Each kernel once on `cell` (Triton compiles here); one that raises is `failed`."""
    q, tables, lens, out = cell_inputs(kv_cache, shape.num_heads, *cell)
    for name, call in calls.items():
        try:
            call(q, tables, lens, cell[1], out)
        except Exception as exc:  # a kernel that cannot run is not chosen; the others are
            logger.warning("decode timing: the %s kernel failed (%s); not chosen", name, exc)
            failed.add(name)


def _time_cell(
    runs: Mapping[str, Callable[[], object]],
    batch: int,
    context: int,
    timer: Timer,
) -> dict[tuple[str, int, int], float]:
    """Median seconds per call of each of `runs` on one cell, the kernels taking turns."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, int] = {}
    for turn in range(REPEATS + 1):  # a probe of one call each (the warm call), then samples
        for name in list(samples):
            try:
                seconds = timer(runs[name], counts.get(name, 1))
            except Exception as exc:  # e.g. out of memory at a large cell: no time there
                cell = f"b{batch} c{context}"
                logger.warning("decode timing: %s at %s failed (%s)", name, cell, exc)
                del samples[name]
                continue
            if turn == 0:
                counts[name] = max(1, min(MAX_CALLS, math.ceil(SAMPLE_S / max(seconds, 1e-9))))
            else:
                samples[name].append(seconds / counts[name])
    return {(name, batch, context): statistics.median(s) for name, s in samples.items()}


def prepare_for_model(model: Any, kv_cache: torch.Tensor) -> list[DecodeTable]:
    """`prepare` for a kvrelay model (its `config`: num_attention_heads, layer_windows and
    attn_logit_softcapping, as kvrelay.config.ModelConfig has them) on its KV cache."""
    config = model.config
    variants = variants_of(config.layer_windows, config.attn_logit_softcapping)
    return prepare(kv_cache, config.num_attention_heads, variants)


def prepare(
    kv_cache: torch.Tensor,
    num_heads: int,
    variants: Iterable[Variant] = ((None, None),),
    *,
    measure_fn: Measure | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[DecodeTable]:
    """Make and install the table of each variant's shape (decodes of `num_heads` query
    heads over `kv_cache`), logging each in one line. Pinned by KVRELAY_DECODE_ATTENTION;
    else timed where `can_time` (or by `measure_fn`, a test's), else the CUDA kernel for
    every step.

    Raises:
        ValueError: KVRELAY_DECODE_ATTENTION is not one of its choices, or pins a kernel that
            cannot run a variant.
    """
    mode = DECODE_ATTENTION.choice(PIN_CHOICES, environ)
    chosen = list(variants)
    budget = BUDGET_S / max(1, len(chosen))
    tables = []
    for variant in chosen:
        shape = shape_of(kv_cache, num_heads, variant[0] is not None, variant[1] is not None)
        runs = supported(kv_cache, num_heads, variant)
        if mode == "auto" and not any(runs.values()):
            logger.info("decode attention (%s): no decode kernel runs it", shape.describe())
            continue  # the cuda backend's own fallback serves such steps
        only = [kernel for kernel, ok in runs.items() if ok]
        if mode != "auto":
            table = pinned_table(shape, mode, runs)
        elif len(only) == 1:  # nothing to choose between: nothing timed
            table = DecodeTable(shape, only[0], f"only the {only[0]} kernel runs it")
        elif measure_fn is None and not can_time(kv_cache):
            table = DecodeTable(shape, CUDA, "unmeasured (no CUDA device to time on)")
        else:
            table = _measured_table(shape, kv_cache, variant, runs, measure_fn, budget)
        install(table)
        logger.info(table.describe())
        tables.append(table)
    return tables


def _measured_table(
    shape: DecodeShape,
    kv_cache: torch.Tensor,
    variant: Variant,
    runs: dict[str, bool],
    measure_fn: Measure | None,
    budget_s: float,
) -> DecodeTable:
    """The table of `shape` from timings taken now; a kernel that got no timing at all
    (it raised) counts as one that does not run the shape."""
    calls = kernel_calls(kv_cache, kv_cache.shape[5] ** -0.5, variant, runs)
    launched = COUNTERS.cuda_decode_calls
    try:
        timings: Timings = (
            measure(shape, calls, kv_cache, budget_s=budget_s)
            if measure_fn is None
            else measure_fn(shape, calls, kv_cache)
        )
    finally:  # the counter proves served steps ran the kernel: timing launches are not those
        COUNTERS.cuda_decode_calls = launched
    timed = {kernel: any(key[0] == kernel for key in timings) for kernel in runs}
    if not any(timed.values()):
        return DecodeTable(shape, CUDA, "unmeasured (no kernel could be timed: see the log)")
    return choose_table(shape, timings, {k: runs[k] and timed[k] for k in runs})
