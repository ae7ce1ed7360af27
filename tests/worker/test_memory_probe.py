"""worker/memory_probe.py: its readings are the process's own (smaps_rollup, mallinfo2, the
tensors it holds, tracemalloc's growth by line), a worker with $KVRELAY_MEMORY_PROBE set writes
its lines (with its structures' sizes) to memory-<pid>.jsonl there, and bad settings are
refused by name."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.engine.args import EngineArgs
from kvrelay.worker import memory_probe
from kvrelay.worker.actor import EngineWorker
from kvrelay.worker.memory_probe import (
    PROBE_ENV,
    PROBE_PERIOD_ENV,
    WORKER_STRUCTURES,
    TracemallocGrowth,
    mallinfo2,
    object_census,
    probe_line,
    smaps_rollup,
    start_probe,
    structure_sizes,
)
from tests.worker.conftest import TINY_ENGINE_KWARGS


def test_smaps_and_mallinfo_are_this_process() -> None:
    smaps = smaps_rollup()
    statm_rss_kb = (
        int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    )
    assert abs(smaps["Rss"] - statm_rss_kb) < 64 * 1024  # the same process, read twice
    assert smaps["Anonymous"] > 0
    info = mallinfo2()
    if not info:
        pytest.skip("libc without mallinfo2")
    before = info["uordblks"] + info["hblkhd"]
    held = [bytearray(4096) for _ in range(4096)]  # 16 MiB handed out by malloc
    after = mallinfo2()
    assert after["uordblks"] + after["hblkhd"] - before >= 15 * 2**20
    del held


def test_the_census_counts_the_tensors_held() -> None:
    before = object_census()
    held = [torch.zeros(2**18) for _ in range(4)]  # 4 MiB in 4 storages
    after = object_census()
    assert after["tensors"] - before["tensors"] >= 4
    assert after["tensor_bytes"] - before["tensor_bytes"] >= 4 * 2**20
    assert held[0].numel() == 2**18


def test_tracemalloc_growth_names_the_line_that_keeps_memory() -> None:
    growth = TracemallocGrowth()
    try:
        assert growth.sample() == []  # the first sample is the base
        kept = [bytes(1000) + bytes([i % 256]) for i in range(2000)]  # ~2 MB kept here
        top = growth.sample()
    finally:
        growth.stop()
    assert top and any(__file__ in where for where in top[0]["where"]), top[0]
    assert top[0]["size_diff"] > 1_500_000
    del kept


def test_a_worker_writes_its_probe_lines(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROBE_ENV, str(tmp_path))
    monkeypatch.setenv(PROBE_PERIOD_ENV, "0.2")
    worker = EngineWorker(EngineArgs(model=str(tiny_llama_dir), **TINY_ENGINE_KWARGS))
    try:
        path = tmp_path / f"memory-{os.getpid()}.jsonl"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(_lines(path)) < 2:
            time.sleep(0.1)
        lines = _lines(path)
        assert len(lines) >= 2
        line = lines[-1]
        assert line["pid"] == os.getpid() and line["smaps_kb"]["Rss"] > 0
        assert line["census"]["tensors"] > 0  # the model's weights
        assert set(WORKER_STRUCTURES) <= set(line["sizes"])
        assert line["sizes"]["engine.kv_cache._tables"] == 0
    finally:
        worker.shutdown()
    # Shut down, the worker's probe is gone: it neither outlives it nor writes on.
    assert worker.memory_probe is not None and not worker.memory_probe.thread.is_alive()
    written = len(_lines(path))
    time.sleep(0.5)
    assert len(_lines(path)) == written


def test_a_failed_census_says_so_and_leaves_the_threads_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(top: int) -> Any:
        raise ValueError("unreadable")

    interval = sys.getswitchinterval()
    monkeypatch.setattr(memory_probe, "_census", broken)
    with pytest.raises(RuntimeError, match="object census failed: ValueError"):
        object_census()
    assert sys.getswitchinterval() == interval


def test_a_census_never_breaks_a_tuple_another_thread_is_building() -> None:
    """gc.get_objects() returns a tuple that tuple(<generator>) is still filling; a census
    holding it when the builder shrinks it made the builder raise SystemError (seen in CI,
    in the engine's step, with a probe left running by an earlier test). Unpaused, this
    failed within a few tuples."""
    held = [list(range(4)) for _ in range(200_000)]  # a census of tens of ms
    stop = threading.Event()
    census_runs = 0

    def census() -> None:
        nonlocal census_runs
        while not stop.is_set():
            object_census()
            census_runs += 1

    thread = threading.Thread(target=census, daemon=True)
    thread.start()
    built = 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            # A generator that gives the census thread its turn mid-build (torch releases
            # the GIL), and no length hint: the tuple is made big and shrunk at the end.
            assert len(tuple(torch.zeros(2).to(torch.int64) for _ in range(3))) == 3
            built += 1
    finally:
        stop.set()
        thread.join(30)
    assert census_runs >= 3 and built > 100, (census_runs, built)
    del held


def _lines(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(raw) for raw in path.read_text().splitlines() if raw.endswith("}")]


def test_no_probe_without_the_setting_and_bad_settings_refused(tmp_path: Path) -> None:
    assert start_probe(None, {}) is None
    with pytest.raises(ValueError, match=PROBE_ENV):
        start_probe(None, {PROBE_ENV: str(tmp_path / "missing")})
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ValueError, match=PROBE_PERIOD_ENV):
            start_probe(None, {PROBE_ENV: str(tmp_path), PROBE_PERIOD_ENV: bad})


def test_structure_sizes_report_a_path_that_does_not_resolve_as_minus_one() -> None:
    class Root:
        channels = None
        items = (1, 2, 3)

    assert structure_sizes(Root(), ("items", "gone.away")) == {
        "items": 3,
        "gone.away": -1,
        "channel tasks": 0,
    }
    line = probe_line(lambda: {"x": 1}, None)
    assert line["sizes"] == {"x": 1} and "tracemalloc" not in line
