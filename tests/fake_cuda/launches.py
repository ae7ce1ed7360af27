"""What counts as a device kernel launch on fake CUDA, and a counter of them.

A decode step's GPU idles while the host launches kernels one by one, so the number of
launches per decoder layer is the figure the fused kernels must bring down. On fake CUDA
every op on a device tensor reaches the dispatch mode (mode.py), but not every one would
launch a kernel on a GPU:

- views (a new tensor header over the same memory: `view`, `t`, `split`, a `to` or
  `contiguous` with nothing to do, ...);
- allocations without a fill (`empty`, `empty_strided`): the caching allocator hands out
  memory on the host, no kernel runs;
- copies between the host and the device: DMA transfers, counted apart as uploads and
  downloads (they cost the host a call, like a launch, but no kernel runs);
- reads of a tensor's metadata that torch's C++ routes through the dispatcher for fake
  tensors only (`prim.device`): not device calls at all.

Every other device op is one launch, counted at the level the engine calls torch (where a
composite like `rms_norm` or `matmul` is one CUDA kernel; the fake tensors' own decompositions
below it are shape arithmetic, not launches; a cuBLAS call that launches two kernels counts
one), and so is each call of a compiled-kernel stand-in (kernels.py logs them); the
stand-ins' own checks dispatch a few ops too, which belong to the rig and are not counted.

This module counts; it does not time (mode.py's RigClock does, and this wraps the stand-ins
in it) and asserts nothing (tests/engine/test_kernels_per_layer.py does).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from tests.fake_cuda import kernels
from tests.fake_cuda.mode import COPIES, FakeCudaMode

_aten = torch.ops.aten
# Outputs over the same memory that the schema does not mark as (possible) views.
NOT_MARKED_VIEWS = frozenset({_aten._unsafe_view})
# Memory from the caching allocator, no kernel: what the op returns is uninitialised (and
# the allocator's bookkeeping of which stream uses a block).
ALLOCATIONS = frozenset({
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty,
    _aten.new_empty_strided, _aten.resize_, _aten.record_stream,
})  # fmt: skip
# Reads of a tensor's header (torch's C++ asks fake tensors for their device through the
# dispatcher; on a GPU that is a field read): no device call at all, not even counted.
METADATA = frozenset({
    torch.ops.prim.device, _aten.sym_size, _aten.sym_stride, _aten.sym_numel,
    _aten.sym_storage_offset, _aten.is_contiguous,
})  # fmt: skip

KERNEL = "kernel"
UPLOAD = "upload"
DOWNLOAD = "download"
NO_LAUNCH = "no_launch"  # a view or an allocation: a torch call on the host, no kernel
IGNORED = "metadata"
STAND_IN = "stand_in:"  # prefix of a compiled-kernel stand-in's name in `Launches.kernels`


def classify(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> str:
    """What the device op `out = func(*args, **kwargs)` costs on a GPU: KERNEL, UPLOAD,
    DOWNLOAD, NO_LAUNCH (views, allocations) or IGNORED (metadata reads)."""
    packet = func.overloadpacket
    if packet in METADATA:
        return IGNORED
    if packet in ALLOCATIONS or packet in NOT_MARKED_VIEWS:
        return NO_LAUNCH
    if func.is_view and _aliases_an_input(out, args):
        # The schema says "may alias": `view`, `split`, `t` always do, while `to`,
        # `contiguous`, `reshape` return their input (or a view of it) only when there is no
        # cast or copy to make; what came back tells which.
        return NO_LAUNCH
    if packet in COPIES:
        return _copy_kind(func, args, kwargs)
    return KERNEL


def _aliases_an_input(out: Any, args: Any) -> bool:
    inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return all(any(torch._C._is_alias_of(o, i) for i in inputs) for o in outputs)  # type: ignore[attr-defined]


def _copy_kind(func: Any, args: Any, kwargs: dict[str, Any]) -> str:
    source = args[1] if func.overloadpacket is _aten.copy_ else args[0]
    if isinstance(source, torch.Tensor) and not isinstance(source, FakeTensor):
        return UPLOAD  # a host tensor in a device op can only be a copy up
    device = kwargs.get("device")
    if device is None and func is _aten.to.device:
        device = args[1]
    to_host = (device is not None and torch.device(device).type == "cpu") or (
        func.overloadpacket is _aten.copy_ and not isinstance(args[0], FakeTensor)
    )
    return DOWNLOAD if to_host else KERNEL  # device -> device: a copy kernel


@dataclass
class Launches:
    """What the engine asked of the device while a counter ran."""

    kernels: collections.Counter[str] = field(default_factory=collections.Counter)  # by op
    uploads: int = 0
    downloads: int = 0
    no_launch: int = 0  # views and allocations

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    @property
    def device_ops(self) -> int:
        """Every device call the host made: launches, copies, views and allocations alike
        (each one a trip through torch's dispatcher on a GPU too)."""
        return self.num_kernels + self.uploads + self.downloads + self.no_launch

    def add(self, other: Launches) -> None:
        self.kernels.update(other.kernels)
        self.uploads += other.uploads
        self.downloads += other.downloads
        self.no_launch += other.no_launch


class LaunchCounter:
    """Counts the device ops of the code run inside `counting()` on `mode`'s fake CUDA.

    The compiled-kernel stand-ins must be wrapped (`wrap_stand_ins`) so that their own checks'
    ops are left out; their calls are read from kernels.LOG."""

    def __init__(self, mode: FakeCudaMode) -> None:
        self._active: list[Launches] = []
        mode.device_op_observers.append(self._observe)

    def _observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if not self._active or _STAND_INS.depth:
            return
        kind = classify(func, args, kwargs, out)
        if kind == IGNORED:
            return
        for launches in self._active:  # nested counters each see the op
            if kind == KERNEL:
                launches.kernels[str(func.overloadpacket.__name__)] += 1
            elif kind == UPLOAD:
                launches.uploads += 1
            elif kind == DOWNLOAD:
                launches.downloads += 1
            else:
                launches.no_launch += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[Launches]:
        """Count until the block ends; the `Launches` it yields fill in meanwhile."""
        launches = Launches()
        logged = len(kernels.LOG.calls)
        self._active.append(launches)
        try:
            yield launches
        finally:
            # Nested counters end in reverse order (and an equal Launches is not this one).
            assert self._active.pop() is launches
            for name, _ in kernels.LOG.calls[logged:]:
                launches.kernels[STAND_IN + name] += 1


@dataclass
class _StandInDepth:
    depth: int = 0  # > 0 while a compiled-kernel stand-in runs (its ops are the rig's)


_STAND_INS = _StandInDepth()


def _wrapped(function: Callable[..., Any], mode: FakeCudaMode) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _STAND_INS.depth += 1
        mode.clock.start()
        try:
            return function(*args, **kwargs)
        finally:
            mode.clock.stop()
            _STAND_INS.depth -= 1

    return call


def wrap_stand_ins(monkeypatch: pytest.MonkeyPatch, mode: FakeCudaMode) -> None:
    """Every stand-in of kernels.py (the `Fake*` classes' static methods, the `fake_*`
    functions) timed as the rig's work (a GPU runs the compiled kernel instead; its launch is
    what a benchmark adds back), its own checks' ops left out of the counts. Call it before
    `kernels.install`, which hands the backends the `fake_*` functions as they are then."""
    for name, value in list(vars(kernels).items()):
        if isinstance(value, type) and name.startswith("Fake"):
            for member, function in list(vars(value).items()):
                if isinstance(function, staticmethod):
                    timed = staticmethod(_wrapped(function.__func__, mode))
                    monkeypatch.setattr(value, member, timed)
        elif name.startswith("fake_") and callable(value):
            monkeypatch.setattr(kernels, name, _wrapped(value, mode))


@contextlib.contextmanager
def counting_layers(
    counter: LaunchCounter, layers: Sequence[torch.nn.Module]
) -> Iterator[Launches]:
    """Count only inside the forward of each of `layers` (a model's decoder layers, which the
    model calls as `layer.forward(...)`): the embedding, the final norm, the logits and the
    sampler are left out. Per layer = the count / len(layers)."""
    total = Launches()

    def counted(forward: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with counter.counting() as launches:
                out = forward(*args, **kwargs)
            total.add(launches)
            return out

        return call

    for layer in layers:
        layer.forward = counted(layer.forward)
    try:
        yield total
    finally:
        for layer in layers:
            del layer.forward  # the class's own again
