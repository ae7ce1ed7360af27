"""Which path a single-row fp32 matmul (a one-stream decode step) takes on this CPU, measured
once when the model is packed.

oneDNN's packed kernel and `layers.linear`'s `W @ x.T` trade places between CPUs. On the
project's 2-core AVX2 EPYC `linear` streamed one fp32 row faster; on a 2-core AVX-512/AMX Xeon
the packed kernel is about twice as fast (the default model's gate_up 954 vs 447 us, its vocab
projection 26.9 vs 11.6 ms, `benchmarks/quantized_decode.py --layers`). So each distinct
weight shape is timed both ways and every packed layer of that shape keeps the faster.
`KVRELAY_CPU_SINGLE_ROW=packed|dense` skips the measurement (the test suite pins `dense`, so
its token-exact checks do not depend on a timing).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

from kvrelay.common.env import CPU_SINGLE_ROW
from kvrelay.models.layers import PackedLinear, linear

SINGLE_ROW_ENV = CPU_SINGLE_ROW.name
_CHOICES = ("auto", "packed", "dense")
_REPEATS = 3  # timed calls per path, alternating, after one warm-up each


def single_row_choice() -> str:
    """`auto` (measure), `packed` or `dense`, from KVRELAY_CPU_SINGLE_ROW.

    Raises:
        ValueError: another value.
    """
    return CPU_SINGLE_ROW.choice(_CHOICES)


def choose_single_row_paths(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor | None, PackedLinear]],
) -> dict[tuple[int, int], bool]:
    """Set `single_row` on every fp32 packed layer: True where its packed kernel is faster
    for one row than `linear` on its dense weight (bf16 packed layers always take it).

    Args:
        layers: (dense weight, bias, packed copy) of each packed matmul.

    Returns:
        Per fp32 weight shape `[out, in]`, whether packed was chosen.
    """
    choice = single_row_choice()
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor | None, PackedLinear]]]
    groups = {}
    for weight, bias, packed in layers:
        if weight.dtype == torch.float32:
            groups.setdefault((weight.shape[0], weight.shape[1]), []).append((weight, bias, packed))
    chosen: dict[tuple[int, int], bool] = {}
    for shape, members in groups.items():
        if choice == "auto":
            weight, bias, packed = members[0]
            chosen[shape] = _packed_is_faster(weight, bias, packed)
        else:
            chosen[shape] = choice == "packed"
        for _, _, packed in members:
            packed.single_row = chosen[shape]
    return chosen


def _packed_is_faster(
    weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinear
) -> bool:
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
    with torch.inference_mode():
        dense_s = _median_seconds(lambda: linear(x, weight, bias))
        packed_s = _median_seconds(lambda: packed.forward(x))
    return packed_s < dense_s


def _median_seconds(fn: Callable[[], torch.Tensor]) -> float:
    fn()  # warm-up: oneDNN picks and caches its kernel on the first call
    times = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
