"""worker/heap_trim.py: a trim once per stretch of work and never sooner than the interval
after the last, none with the interval 0, the setting's bad values refused by name; glibc's
real malloc_trim gives freed heap memory back; and an EngineLoop on the tiny model trims once
its request is done, never while it runs."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from pathlib import Path

import pytest

from kvrelay.common.messages import EngineRequest
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay.worker.actor import EngineWorker
from kvrelay.worker.deltas import request_deltas
from kvrelay.worker.heap_trim import (
    BUSY_FACTOR,
    DEFAULT_INTERVAL_S,
    HEAP_TRIM_ENV,
    HeapTrimmer,
    interval_from_env,
    rss_bytes,
)
from tests.worker.conftest import TINY_ENGINE_KWARGS


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counting_trimmer(interval_s: float) -> tuple[HeapTrimmer, list[int], FakeClock]:
    calls: list[int] = []
    clock = FakeClock()

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    return HeapTrimmer(interval_s, trim=trim, clock=clock, rss=lambda: 0), calls, clock


def test_trims_once_per_stretch_of_work_and_at_most_once_per_interval() -> None:
    trimmer, calls, clock = counting_trimmer(10.0)
    clock.now += 10.0
    assert not trimmer.idle()  # no work yet: nothing to give back
    assert not trimmer.worked()  # busy, but not for long
    assert trimmer.idle() and calls == [0]  # malloc_trim(0): keep no pad at the top
    assert not trimmer.idle()  # idle on: no work since
    trimmer.worked()
    clock.now += 9.9
    assert not trimmer.idle()  # too soon after the last trim
    clock.now += 0.2
    assert trimmer.idle() and len(calls) == 2
    assert trimmer.stats.trims == 2


def test_a_long_busy_stretch_trims_between_steps() -> None:
    trimmer, calls, clock = counting_trimmer(10.0)
    for _ in range(59):  # a step a second, never idle: no trim for the first minute
        clock.now += 1.0
        assert not trimmer.worked()
    clock.now += 1.0
    assert trimmer.worked() and calls == [0]  # BUSY_FACTOR (6) intervals without a trim
    clock.now += 1.0
    assert not trimmer.worked() and not trimmer.idle()  # the last trim was a second ago
    assert BUSY_FACTOR == 6


def test_interval_zero_never_trims() -> None:
    trimmer, calls, _ = counting_trimmer(0.0)
    trimmer.worked()
    assert not trimmer.enabled and not trimmer.idle() and calls == []


def test_the_setting_is_read_and_bad_values_are_refused_by_name() -> None:
    assert interval_from_env({}) == DEFAULT_INTERVAL_S
    assert interval_from_env({HEAP_TRIM_ENV: "2.5"}) == 2.5
    assert interval_from_env({HEAP_TRIM_ENV: "0"}) == 0.0
    for bad in ("-1", "often", "nan"):
        with pytest.raises(ValueError, match=HEAP_TRIM_ENV):
            interval_from_env({HEAP_TRIM_ENV: bad})
    with pytest.raises(ValueError, match="interval_s"):
        HeapTrimmer(-1.0)


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim"),
    reason="no glibc malloc_trim",
)
def test_glibc_trim_gives_freed_heap_memory_back() -> None:
    # Small objects come from the heap, not mmap: freed with a live one after them (the
    # heap's top is pinned), glibc keeps them until a trim returns their pages.
    blocks = [bytearray(512) for _ in range(200_000)]  # ~110 MiB of small chunks
    keep = bytearray(512)
    del blocks
    before = rss_bytes()
    clock = FakeClock()
    trimmer = HeapTrimmer(1.0, clock=clock)
    trimmer.worked()
    clock.now += 1.0
    assert trimmer.idle()
    released = before - rss_bytes()
    assert released > 50 * 2**20, released
    assert trimmer.stats.released_bytes == released
    del keep


def test_a_worker_loop_trims_once_its_request_is_done(tiny_llama_dir: Path) -> None:
    worker = EngineWorker(EngineArgs(model=str(tiny_llama_dir), **TINY_ENGINE_KWARGS))
    trimmer, calls, clock = counting_trimmer(10.0)
    clock.now += 20.0  # past the interval (an idle moment trims), short of a busy trim's 60 s
    worker.loop.heap_trimmer = trimmer
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)

    async def run() -> int:
        trims_while_running = []
        async for _ in request_deltas(worker.loop, EngineRequest("a", [5, 6, 7, 8], params)):
            trims_while_running.append(len(calls))
        for _ in range(100):  # the loop goes idle within its idle wait (0.2 s)
            if calls:
                break
            await asyncio.sleep(0.01)
        return max(trims_while_running)

    try:
        # A trim may run between requests, never between a request's steps (it had work).
        assert asyncio.run(run()) == 0
        assert trimmer.stats.trims == 1
    finally:
        worker.shutdown()


def test_only_a_worker_that_owns_its_process_trims(tiny_llama_dir: Path) -> None:
    worker = EngineWorker(EngineArgs(model=str(tiny_llama_dir), **TINY_ENGINE_KWARGS))
    try:
        assert worker.loop.heap_trimmer is None  # a test's or a caller's process: not ours
    finally:
        worker.shutdown()
