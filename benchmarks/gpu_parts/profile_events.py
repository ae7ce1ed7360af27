"""torch.profiler's events reduced to what part 3 reports: the device's busy time per step,
kernel counts, and kernels per decoder layer by differencing two model depths.

Pure arithmetic over `DeviceEvent`s (name, start, end in microseconds), so the CPU tests can
feed it fake events; `device_events` / `cpu_op_counts` adapt a real profiler's event list.
No torch import at module level.

Kernels per layer are counted by differencing: one pure-decode step of the model at its full
depth L and of the same shape only l layers deep. The layers are identical, so
(count(L) - count(l)) / (L - l) is exactly one layer's kernels, name by name, and whatever
runs outside the layers (embedding, final norm, lm_head, sampling, the step's uploads) is the
remainder. Counting the kernels between the first and the last layer's attention kernel
would need to recognise that kernel by name, which a fused or renamed kernel breaks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Device activities that are copies or fills, not kernels (CUPTI's names for them).
NOT_KERNELS = ("memcpy", "memset")


@dataclass(frozen=True)
class DeviceEvent:
    """One activity on the device's timeline."""

    name: str
    start_us: float
    end_us: float


def is_kernel(name: str) -> bool:
    lowered = name.lower()
    return not any(word in lowered for word in NOT_KERNELS)


def device_events(events: Iterable[Any]) -> list[DeviceEvent]:
    """The CUDA activities (kernels, copies, fills) among a profiler's `events()`; a
    record_function range projected onto the GPU's timeline (a "gpu_user_annotation", which
    spans kernels rather than being one) is left out."""
    from torch.autograd import DeviceType

    return [
        DeviceEvent(e.name, float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and "annotation" not in str(getattr(e, "activity_type", None) or "")
    ]


def cpu_op_counts(events: Iterable[Any]) -> Counter[str]:
    """Top-level aten ops (those not called by another aten op): on a CPU, where no kernel
    runs, what stands in for kernels so the counting code still runs."""
    from torch.autograd import DeviceType

    counts: Counter[str] = Counter()
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        if parent is None or not parent.name.startswith("aten::"):
            counts[e.name] += 1
    return counts


def busy_us(events: Iterable[DeviceEvent]) -> float:
    """Time the device was doing something: the union of the events' intervals (kernels on
    two streams at once count once)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.start_us):
        if e.end_us <= end:
            continue
        total += e.end_us - max(e.start_us, end)
        end = e.end_us
    return total


def kernel_counts(events: Iterable[DeviceEvent]) -> Counter[str]:
    """Launches per kernel name, copies and fills left out."""
    return Counter(e.name for e in events if is_kernel(e.name))


@dataclass(frozen=True)
class LayerKernels:
    """Kernels of one decoder layer, and those of the rest of a step."""

    per_layer: float
    outside: float
    top: list[tuple[str, float]]  # (kernel name, launches per layer), most first


def per_layer(
    deep: Counter[str] | dict[str, float],
    deep_layers: int,
    shallow: Counter[str] | dict[str, float],
    shallow_layers: int,
    top: int = 6,
) -> LayerKernels:
    """Kernels per layer from one step's counts at two depths (module docstring). A name
    whose count shrinks with depth (never, for identical layers) lowers the total as it
    should, and is left out of `top`."""
    if deep_layers <= shallow_layers:
        raise ValueError(f"need two depths, deeper first: {deep_layers} vs {shallow_layers}")
    span = deep_layers - shallow_layers
    names = set(deep) | set(shallow)
    each = {n: (deep.get(n, 0) - shallow.get(n, 0)) / span for n in names}
    total = sum(each.values())
    outside = sum(shallow.values()) - shallow_layers * total
    ranked = sorted(((n, c) for n, c in each.items() if c > 0), key=lambda x: (-x[1], x[0]))
    return LayerKernels(total, outside, ranked[:top])


def short_name(name: str, width: int = 48) -> str:
    """A kernel's name for a table cell: no `void `, no anonymous namespace, no argument list
    (template arguments kept: cutlass and friends name the kernel there), cut at `width`."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth = 0
    for i, char in enumerate(name):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "(" and depth == 0 and i > 0:
            name = name[:i]
            break
    return name if len(name) <= width else name[: width - 3] + "..."
