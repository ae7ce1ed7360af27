"""The fake-CUDA rig's own cost per dispatched op, measured: what benchmarks/host_overhead.py
takes off its timings so that they say what a real GPU's host would spend. It measures only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tests.fake_cuda.mode import FakeCudaMode


@dataclass(frozen=True)
class Calibration:
    """CPU seconds per op that the rig costs outside its clock's spans: torch's C++ -> Python
    trip into the dispatch mode and back, and a fake result's teardown. Measured at start on a
    mix of ops like a step's (views, copies, casts, kernels)."""

    host_s: float  # a host op dispatched through the mode, beyond the op's own cost
    device_s: float  # a device op's whole cost outside the spans: the median of the mix
    device_low_s: float  # the cheapest op of the mix
    device_high_s: float  # the dearest


def _cpu_per_call(call: Callable[[], object], mode: FakeCudaMode, calls: int) -> tuple[float, ...]:
    """CPU seconds per call of `call`: in all, in the rig's spans, and the mode's host and
    device dispatches per call."""
    clock, host, device = mode.clock.seconds, mode.host_dispatches, mode.device_dispatches
    start = time.thread_time()
    for _ in range(calls):
        call()
    total = time.thread_time() - start
    span = mode.clock.seconds - clock
    host, device = mode.host_dispatches - host, mode.device_dispatches - device
    return total / calls, span / calls, host / calls, device / calls


def calibrate(mode: FakeCudaMode, calls: int = 2000, repeats: int = 3) -> Calibration:
    """Time a mix of host and device ops with and without the mode (see Calibration)."""
    a, b = torch.ones(8), torch.ones(8)
    host_ops: list[Callable[[], object]] = [
        lambda: torch.add(a, b), lambda: a[:4], lambda: a.view(2, 4), lambda: b.copy_(a),
    ]  # fmt: skip
    host = []
    for op in host_ops * repeats:
        bare, *_ = _cpu_per_call(op, mode, calls)
        with mode:
            total, span, dispatches, _ = _cpu_per_call(op, mode, calls)
        host.append((total - span - bare) / dispatches)
    with mode:
        x = torch.empty(64, 576, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        rows = torch.arange(4).to("cuda", non_blocking=True)
        device_ops: dict[str, Callable[[], object]] = {
            "slice": lambda: x[:4], "view": lambda: x.view(64, 9, 64),
            "view_dtype": lambda: x.view(torch.int16), "copy": lambda: y.copy_(x),
            "add": lambda: x + 1, "index": lambda: x[rows], "cast": lambda: x.float(),
        }  # fmt: skip
        device = []
        for op in device_ops.values():
            costs = []
            for _ in range(repeats):
                total, span, _, dispatches = _cpu_per_call(op, mode, calls // 4)
                costs.append((total - span) / dispatches)
            device.append(statistics.median(costs))
    return Calibration(
        max(0.0, statistics.median(host)), statistics.median(device), min(device), max(device)
    )
