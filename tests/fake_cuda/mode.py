"""The dispatch mode behind fake CUDA: tensors on `cuda` are fake (shapes, dtypes, strides, no
data), host tensors stay real, and while `strict` every host-device rule of a decode step is
enforced. A broken rule raises at once and is recorded too, because the engine catches some
errors itself (a sampling failure fails one request) and a test must still see it."""

from __future__ import annotations

import contextlib
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

    @contextlib.contextmanager
    def strict_rules(self) -> Iterator[None]:
        """Enforce the hot loop's rules inside (steps, graph capture)."""
        before, self.strict = self.strict, True
        try:
            yield
        finally:
            self.strict = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            # No pinned allocator without CUDA: a plain host buffer stands in (counted).
            kwargs["pin_memory"] = False
            self.pinned_allocations += 1
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        target = _target_device(func, args, kwargs)
        if not fakes and (target is None or target.type != "cuda"):
            return func(*args, **kwargs)  # host work: real tensors, real values
        if self.strict:
            self.device_ops += 1
            self._check(func, args, kwargs, tensors, fakes, target)
        with self.fake:
            try:
                return func(*tree_map(self._to_fake, args), **tree_map(self._to_fake, kwargs))
            except DataDependentOutputException:
                self._violate(f"{func}: reads a device value on the host (a sync)")
                raise

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
