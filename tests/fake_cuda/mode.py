"""The dispatch mode behind fake CUDA: tensors on `cuda` are fake (shapes, dtypes, strides, no
data), host tensors stay real, and while `strict` every host-device rule of a decode step is
enforced. A broken rule raises at once and is recorded too, because the engine catches some
errors itself (a sampling failure fails one request) and a test must still see it.

For measurements it also keeps the rig's own CPU time (RigClock), counts the ops it was called
for, and tells observers of each device op (launches.py counts launches that way); it neither
decides what a launch is nor corrects any timing itself (benchmarks/host_overhead.py does)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_aten = torch.ops.aten
COPIES = (_aten._to_copy, _aten.copy_, _aten.to)  # the ops that move data between devices
# Where `non_blocking` sits among the positional arguments of the copies that take it so.
_NON_BLOCKING_AT = {_aten.copy_.default: 2, _aten.to.device: 3}
# Called with (func, args, kwargs, result) after each op on the device, strict or not
# (launches.py counts them).
DeviceOpObserver = Callable[[Any, Any, dict[str, Any], Any], None]


class RigClock:
    """CPU seconds this thread spends on the rig's own work: fake-tensor dispatch and the
    kernel stand-ins' checks, which a run on a real GPU does not do (benchmarks/
    host_overhead.py subtracts them). Nested spans (an op dispatched inside a stand-in) count
    once. CPU time, not wall time: on a shared machine the wall clock also runs while other
    processes have the core, and the rig's share of that would be a guess (a read costs
    about 1 us here, next to 100+ us of fake dispatch)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._since = 0.0

    def start(self) -> None:
        if self._depth == 0:
            self._since = time.thread_time()
        self._depth += 1

    @property
    def running(self) -> bool:
        return self._depth > 0

    def elapsed(self) -> float:
        """`seconds`, with the open span's time so far (a profiler's timer reads it)."""
        if self._depth:
            return self.seconds + time.thread_time() - self._since
        return self.seconds

    def stop(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.thread_time() - self._since


class FakeCudaMode(TorchDispatchMode):
    """Fake tensors for everything on `cuda`; real tensors for everything else."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.strict = False
        self.violations: list[str] = []
        self.uploads = 0  # non-blocking host -> device copies while strict
        self.device_ops = 0  # ops on fake CUDA tensors while strict
        self.pinned_allocations = 0
        # For measurements: the ops this mode was called for outside the clock's spans, on the
        # host and on the device (each paid torch's C++ -> Python trip, which the clock cannot
        # time), the rig's own CPU time, and the device ops' observers.
        self.host_dispatches = 0
        self.device_dispatches = 0
        self.clock = RigClock()
        self.device_op_observers: list[DeviceOpObserver] = []

    @contextlib.contextmanager
    def strict_rules(self) -> Iterator[None]:
        """Enforce the hot loop's rules inside (steps, graph capture)."""
        before, self.strict = self.strict, True
        try:
            yield
        finally:
            self.strict = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        outermost = not self.clock.running
        # Timed as the rig's, except a host op's own call: a run on a GPU makes that one too.
        self.clock.start()
        try:
            kwargs = dict(kwargs or {})
            if kwargs.get("pin_memory"):
                # No pinned allocator without CUDA: a plain host buffer stands in (counted).
                kwargs["pin_memory"] = False
                self.pinned_allocations += 1
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            fakes = [t for t in tensors if isinstance(t, FakeTensor)]
            target = _target_device(func, args, kwargs)
            if fakes or (target is not None and target.type == "cuda"):
                self.device_dispatches += outermost
                return self._device_op(func, args, kwargs, tensors, fakes, target)
            self.host_dispatches += outermost
        finally:
            self.clock.stop()
        return func(*args, **kwargs)  # host work: real tensors, real values

    def _device_op(
        self,
        func: Any,
        args: Any,
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
        fakes: Sequence[torch.Tensor],
        target: torch.device | None,
    ) -> Any:
        if self.strict:
            self.device_ops += 1
            self._check(func, args, kwargs, tensors, fakes, target)
        with self.fake:
            try:
                out = func(*tree_map(self._to_fake, args), **tree_map(self._to_fake, kwargs))
            except DataDependentOutputException:
                self._violate(f"{func}: reads a device value on the host (a sync)")
                raise
        for observe in self.device_op_observers:
            observe(func, args, kwargs, out)
        return out

    def _to_fake(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return self.fake.from_tensor(value)
        return value

    def _check(
        self,
        func: Any,
        args: Any,
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
        fakes: Sequence[torch.Tensor],
        target: torch.device | None,
    ) -> None:
        # Zero-dim host tensors are scalars: torch passes them to kernels by value.
        host = [t for t in tensors if not isinstance(t, FakeTensor) and t.dim() > 0]
        if func.overloadpacket in COPIES:
            to_host = (target is not None and target.type == "cpu") or (
                func.overloadpacket is _aten.copy_ and not isinstance(args[0], FakeTensor)
            )
            if fakes and to_host and not non_blocking(func, args, kwargs):
                self._violate(f"{func}: a blocking device -> host copy (a sync)")
            elif host and not non_blocking(func, args, kwargs):
                shapes = [tuple(t.shape) for t in host]
                self._violate(f"{func}: a blocking host -> device copy of {shapes}")
            elif host:
                self.uploads += 1
        elif host:
            shapes = [tuple(t.shape) for t in host]
            self._violate(f"{func} mixes host tensors {shapes} into a device op")

    def _violate(self, what: str) -> None:
        self.violations.append(what)
        raise AssertionError(f"fake CUDA: {what}")


def _target_device(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.device | None:
    """The device a factory or copy puts its result on, when it names one."""
    device = kwargs.get("device")
    if device is None and func is _aten.to.device and len(args) > 1:
        device = args[1]
    return None if device is None else torch.device(device)


def non_blocking(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether copy op `func` was called with non_blocking=True (keyword or positional)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    position = _NON_BLOCKING_AT.get(func)
    return position is not None and len(args) > position and bool(args[position])


def host_tensor_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`torch.tensor` that builds on the host and then moves: `torch.tensor(data, device=cuda)`
    copies inside torch, out of a dispatch mode's sight, so it could not make a fake tensor.
    (On a GPU it is a blocking upload: the engine must not call it in a step; while strict the
    move is checked like any other.)"""

    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        built = factory(data, *args, **kwargs)
        return built if device is None else built.to(device)

    return tensor
