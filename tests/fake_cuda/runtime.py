"""A stand-in CUDA runtime for fake CUDA: one H200-like device, events, streams and graphs that
record what was asked of them, and memory figures for the KV-cache sizing. Installed into
`torch.cuda` by `install` (process-wide: run it in a process of its own)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.fake_cuda.mode import FakeCudaMode, host_tensor_factory

GIB = 1 << 30
TOTAL_MEMORY = 141 * GIB
FREE_MEMORY = 120 * GIB  # 21 GiB "used" by the CUDA context, other processes and the weights
PEAK_ALLOCATION = 256 << 20  # what the profiling step "allocated" at its peak
NUM_SMS = 132


@dataclass
class RuntimeLog:
    """What the engine asked of the runtime."""

    events_recorded: int = 0
    events_waited: int = 0  # Event.synchronize: the host waits
    stream_waits: int = 0  # Stream.wait_stream / wait_event: the device waits
    graph_captures: int = 0
    graph_replays: int = 0
    synchronizes: int = 0  # torch.cuda.synchronize


LOG = RuntimeLog()


class FakeEvent:
    def __init__(self, *_: Any, **__: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        LOG.events_recorded += 1

    def synchronize(self) -> None:
        assert self.recorded, "waiting on an event that was never recorded"
        LOG.events_waited += 1

    def wait(self, stream: Any = None) -> None:
        LOG.stream_waits += 1

    def query(self) -> bool:
        return True


class FakeStream:
    def __init__(self, device: Any = None, *_: Any, **__: Any) -> None:
        self.device = device

    def wait_stream(self, other: Any) -> None:
        LOG.stream_waits += 1

    def wait_event(self, event: Any) -> None:
        LOG.stream_waits += 1

    def synchronize(self) -> None:
        LOG.synchronizes += 1

    def record_event(self, event: Any = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event


class FakeGraph:
    """Capture runs the captured code once (the fake tensors' shapes are what matter)."""

    def replay(self) -> None:
        LOG.graph_replays += 1

    def pool(self) -> tuple[str, int]:
        return ("fake-pool", id(self))


@contextlib.contextmanager
def _nothing(*_: Any, **__: Any) -> Iterator[None]:
    yield


def _synchronize(*_: Any) -> None:
    LOG.synchronizes += 1


def install(monkeypatch: pytest.MonkeyPatch, mode: FakeCudaMode) -> None:
    """Make torch in this process believe it has one CUDA device backed by `mode`."""
    load_guard()
    cuda = torch.cuda

    @contextlib.contextmanager
    def capture(graph: FakeGraph, **_: Any) -> Iterator[None]:
        LOG.graph_captures += 1
        with mode.strict_rules():  # a real capture fails on any sync or blocking copy
            yield

    for name, value in {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "synchronize": _synchronize,
        "empty_cache": lambda: None,
        "mem_get_info": lambda *_: (FREE_MEMORY, TOTAL_MEMORY),
        "memory_allocated": lambda *_: 0,
        "max_memory_allocated": lambda *_: PEAK_ALLOCATION,
        "reset_peak_memory_stats": lambda *_: None,
        "get_device_properties": lambda *_: SimpleNamespace(
            name="fake H200", multi_processor_count=NUM_SMS, total_memory=TOTAL_MEMORY
        ),
        "Event": FakeEvent,
        "Stream": FakeStream,
        "current_stream": lambda *_: FakeStream(),
        "stream": _nothing,
        "device": _nothing,
        "CUDAGraph": FakeGraph,
        "graph": capture,
    }.items():
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "tensor", host_tensor_factory(torch.tensor))


def load_guard() -> None:
    """Build (once, cached by torch) and load the no-op CUDA device guard.

    Raises:
        RuntimeError: this torch has CUDA: the guard would replace the real one.
    """
    if torch.backends.cuda.is_built():
        raise RuntimeError("fake CUDA is for CPU-only torch builds; this one has CUDA")
    from torch.utils.cpp_extension import load

    load("kvrelay_fake_cuda_guard", [str(Path(__file__).with_name("guard.cpp"))])
