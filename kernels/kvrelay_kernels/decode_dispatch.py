"""Which kernel computes a step's decode rows under the `cuda` backend: kvrelay's CUDA decode
kernel or the Triton one (`triton_attention.decode_attention`), per (batch, context) bucket,
from timings of both taken on the device at load (decode_timing.py) or pinned by
KVRELAY_DECODE_ATTENTION=cuda|triton.

The choice is a pure function of the timings (`choose_table`), tested on CPU with made-up
ones. Per cell (batch bucket x context bucket, both kernels timed) Triton must be `TIE`
faster to take it: a tie keeps the CUDA kernel, the backend's own. A step's (decodes, longest
context) reads the nearest timed cell (log2 distance; a tie goes to the larger bucket, where
the time is). A kernel that refuses the shape or a variant (sliding window, soft cap) is never
chosen; with one kernel left it takes every step.

CUDA graphs. A decode step is captured once per padded batch size and replayed for every
context, so a graph can hold only one kernel: graphed steps follow the table's per-batch
`rows`, each the kernel whose times summed over that batch's timed contexts are lower (so
the long contexts, where attention costs most, decide), with the same tie rule. A graph's
plan is the one with a fixed split-K count (`plan.decode_partitions` > 0: graph_padding.py),
which is how `kernel_for_step` tells a graphed step (its capture and the warm-up call before
it) from an eager one. Eager steps follow the cells. Either way the kernel that runs is the
table's for that step: a replay runs what its capture chose, and nothing else decides.

Nothing here touches a device; without a table for a shape (no engine measured it: a direct
caller, a test) every step takes the CUDA kernel, as before this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

CUDA, TRITON = "cuda", "triton"
KERNELS = (CUDA, TRITON)
PIN_CHOICES = ("auto", CUDA, TRITON)  # KVRELAY_DECODE_ATTENTION's values
# Decodes per step and context lengths timed at load: the batch sizes graphs are captured
# around, and the contexts where issue 37 saw the two kernels part (>= 2048).
BATCH_BUCKETS = (1, 16, 64, 256)
CONTEXT_BUCKETS = (128, 512, 2048, 8192)
TIE = 0.03  # Triton must be 3% faster to take a cell or a row: noise keeps the CUDA kernel

Cell = tuple[int, int]  # (batch bucket, context bucket)
Timings = Mapping[tuple[str, int, int], float]  # (kernel, batch, context) -> seconds a call


class DecodeShape(NamedTuple):
    """What a decode kernel's speed depends on besides the batch: the attention shape of the
    model's layers, its cache's block size and dtype, and the per-layer variants it uses."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    sliding_window: bool
    soft_cap: bool

    def describe(self) -> str:
        variants = [v for v, on in (("window", self.sliding_window), ("cap", self.soft_cap)) if on]
        dtype = str(self.dtype).removeprefix("torch.")
        extra = f" +{'+'.join(variants)}" if variants else ""
        return (
            f"{self.num_heads}/{self.num_kv_heads} heads x {self.head_dim} {dtype}, "
            f"block {self.block_size}{extra}"
        )


def shape_of(
    kv_cache: torch.Tensor, num_heads: int, sliding_window: bool, soft_cap: bool
) -> DecodeShape:
    """The shape key of decodes of `num_heads` query heads over `kv_cache` (block-major:
    `[blocks, layers, 2, block_size, kv_heads, head_dim]`)."""
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    return DecodeShape(
        num_heads, int(kv_heads), int(head_dim), kv_cache.dtype, int(block_size),
        sliding_window, soft_cap,
    )  # fmt: skip


def _faster(cuda_s: float, triton_s: float, tie: float) -> str:
    return TRITON if triton_s < (1.0 - tie) * cuda_s else CUDA


@dataclass(frozen=True)
class DecodeTable:
    """The kernel for each decode step of one shape.

    `cells`: per timed (batch, context) bucket, for eager steps; `rows`: per timed batch
    bucket, for graphed steps; `default`: where neither has an entry (nothing timed, or one
    kernel only); `source`: measured, pinned or unmeasured (the log says which)."""

    shape: DecodeShape
    default: str
    source: str
    cells: Mapping[Cell, str] = field(default_factory=dict)
    rows: Mapping[int, str] = field(default_factory=dict)
    timings: Timings = field(default_factory=dict)

    def kernel_for(self, batch: int, context: int) -> str:
        """The kernel of an eager step of `batch` decodes whose longest context is `context`."""
        if not self.cells:
            return self.default
        return self.cells[_nearest_cell(self._cell_logs, batch, context)]

    @functools.cached_property
    def _cell_logs(self) -> list[tuple[float, float, Cell]]:
        """Each cell with its log2 batch and context, worked out once per table."""
        return [(_log2(b), _log2(c), (b, c)) for b, c in self.cells]

    def graph_kernel_for(self, batch: int) -> str:
        """The kernel a graph of `batch` decodes (padded size) captures."""
        if not self.rows:
            return self.default
        return self.rows[_nearest(self.rows, batch)]

    def describe(self) -> str:
        """One line for the log: the shape, where the choice came from, and each cell."""
        head = f"decode attention ({self.shape.describe()}): {self.source}"
        if not self.cells:
            return f"{head}, {self.default} for every step"
        cells = " ".join(f"b{b}/c{c}={k}" for (b, c), k in sorted(self.cells.items()))
        rows = " ".join(f"b{b}={k}" for b, k in sorted(self.rows.items()))
        return f"{head}; eager {cells}; graphs {rows}"

    def grid(self) -> list[str]:
        """The cells as a small table (rows: batch; columns: context), with both kernels'
        microseconds where timed, and each batch's graph choice."""
        contexts = sorted({c for _, b, c in self.timings} | {c for _, c in self.cells})
        batches = sorted({b for _, b, _ in self.timings} | {b for b, _ in self.cells})
        lines = [f"{'batch':>5} " + " ".join(f"{'c' + str(c):>22}" for c in contexts) + "  graph"]
        for b in batches:
            cells = []
            for c in contexts:
                us = [self.timings.get((k, b, c)) for k in KERNELS]
                times = "/".join("-" if t is None else f"{t * 1e6:.0f}" for t in us)
                cells.append(f"{self.cells.get((b, c), '-') + ' ' + times:>22}")
            lines.append(f"{b:>5} " + " ".join(cells) + f"  {self.rows.get(b, '-')}")
        return lines


def _log2(value: int) -> float:
    return math.log2(max(value, 1))


def _nearest(keys: Iterable[int], value: int) -> int:
    """The key nearest `value` in log2 distance; a tie goes to the larger key."""
    target = _log2(value)
    return min(keys, key=lambda k: (abs(_log2(k) - target), -k))


def _nearest_cell(cells: Iterable[tuple[float, float, Cell]], batch: int, context: int) -> Cell:
    """The cell nearest (batch, context), log2 distances added (`cells` with their logs);
    ties to the larger context, then the larger batch."""
    lb, lc = _log2(batch), _log2(context)
    best = min(cells, key=lambda e: (abs(e[0] - lb) + abs(e[1] - lc), -e[2][1], -e[2][0]))
    return best[2]


def supported_kernels(supported: Mapping[str, bool]) -> list[str]:
    """The kernels, in KERNELS order, that `supported` says can run the shape."""
    unknown = set(supported) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown decode kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    return [k for k in KERNELS if supported.get(k, False)]


def choose_table(
    shape: DecodeShape, timings: Timings, supported: Mapping[str, bool], tie: float = TIE
) -> DecodeTable:
    """The table the timings make: per cell timed for both kernels, the faster (Triton by
    more than `tie`); per batch bucket, the lower sum over its cells (graphs). A cell timed for
    one kernel only (the other failed or the time budget ran out) is left out: steps there read
    the nearest complete cell.

    Raises:
        ValueError: neither kernel supports the shape, or a timing is not a positive number.
    """
    runnable = supported_kernels(supported)
    if not runnable:
        raise ValueError(
            f"neither decode kernel runs {shape.describe()}; the cuda backend sends such "
            "steps to its fallback and needs no table"
        )
    for key, seconds in timings.items():
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"decode timing {key} must be a positive number, got {seconds!r}")
    if len(runnable) == 1:
        return DecodeTable(shape, runnable[0], "measured (one kernel runs it)", timings=timings)
    complete = sorted(
        {(b, c) for _, b, c in timings if (CUDA, b, c) in timings and (TRITON, b, c) in timings}
    )
    cells = {
        cell: _faster(timings[(CUDA, *cell)], timings[(TRITON, *cell)], tie) for cell in complete
    }
    rows: dict[int, str] = {}
    for batch in sorted({b for b, _ in complete}):
        mine = [cell for cell in complete if cell[0] == batch]
        sums = [sum(timings[(k, *cell)] for cell in mine) for k in (CUDA, TRITON)]
        rows[batch] = _faster(sums[0], sums[1], tie)
    source = "measured" if cells else "measured (no cell timed for both: default)"
    return DecodeTable(shape, CUDA, source, cells, rows, timings)


def pinned_table(shape: DecodeShape, kernel: str, supported: Mapping[str, bool]) -> DecodeTable:
    """Every step on `kernel` (KVRELAY_DECODE_ATTENTION pins it); `auto` is not a kernel.

    Raises:
        ValueError: `kernel` is unknown or cannot run this shape (a pin is never ignored).
    """
    if kernel not in KERNELS:
        raise ValueError(f"decode kernel {kernel!r}: use one of {', '.join(KERNELS)}")
    if kernel not in supported_kernels(supported):
        raise ValueError(
            f"KVRELAY_DECODE_ATTENTION={kernel}, but the {kernel} decode kernel does not run "
            f"{shape.describe()}; unset it (auto) or pin the other kernel"
        )
    return DecodeTable(shape, kernel, "pinned")


# The tables in force, per shape: set at load (decode_timing.prepare), read at every step.
_TABLES: dict[DecodeShape, DecodeTable] = {}
# Each layer of a step asks the same question: answered once per step (by what makes the
# shape key, the step's decodes and context, and graphed or not).
_ANSWERS: dict[tuple[object, ...], str] = {}
_MAX_ANSWERS = 256  # then forgotten: contexts grow by one token a step


def install(table: DecodeTable) -> None:
    """Make `table` decide the steps of its shape in this process (replacing an older one)."""
    _TABLES[table.shape] = table
    _ANSWERS.clear()


def installed() -> list[DecodeTable]:
    """The tables in force (what a report prints)."""
    return list(_TABLES.values())


def clear() -> None:
    """Forget every table (tests; every step then takes the CUDA kernel)."""
    _TABLES.clear()
    _ANSWERS.clear()


def kernel_for_step(
    num_heads: int,
    kv_cache: torch.Tensor,
    batch: int,
    context: int,
    graphed: bool,
    sliding_window: bool = False,
    soft_cap: bool = False,
) -> str:
    """The kernel of a step's `batch` decode rows (longest context `context`) on `kv_cache`:
    the installed table's (`graph_kernel_for` when `graphed`), else CUDA."""
    if not _TABLES:  # the common case off a measured engine: no key built
        return CUDA
    key = (kv_cache.shape, kv_cache.dtype, num_heads, batch, context, graphed, sliding_window,
           soft_cap)  # fmt: skip
    answer = _ANSWERS.get(key)
    if answer is None:
        if len(_ANSWERS) >= _MAX_ANSWERS:
            _ANSWERS.clear()
        answer = _ANSWERS[key] = _answer(
            num_heads, kv_cache, batch, context, graphed, sliding_window, soft_cap
        )
    return answer


def _answer(
    num_heads: int,
    kv_cache: torch.Tensor,
    batch: int,
    context: int,
    graphed: bool,
    sliding_window: bool,
    soft_cap: bool,
) -> str:
    table = _TABLES.get(shape_of(kv_cache, num_heads, sliding_window, soft_cap))
    if table is None:
        return CUDA
    return table.graph_kernel_for(batch) if graphed else table.kernel_for(batch, context)
