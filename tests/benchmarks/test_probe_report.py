"""benchmarks/serving/probe_report.py: a worker's probe lines summarized from its first line
after the warm-up to its last (heap in use vs kept free, objects, the sizes that changed, the
types that grew, tracemalloc's top lines), named by role, a cut-off last line skipped; and a
real probe line from this process reads back."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from kvrelay.worker.memory_probe import probe_line
from tests.benchmarks import scripts

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


def report_module() -> ModuleType:
    scripts.load_script(REPO / "benchmarks" / "memory_soak.py")
    return sys.modules["serving.probe_report"]


def line(t: float, in_use_mib: int, free_mib: int, tables: int, sets: int) -> dict[str, Any]:
    return {
        "t": t,
        "pid": 7,
        "threads": 20,
        "smaps_kb": {"Rss": (in_use_mib + free_mib) * 1024, "Anonymous": in_use_mib * 1024},
        "mallinfo2": {"uordblks": in_use_mib * MIB, "hblkhd": 0, "fordblks": free_mib * MIB},
        "census": {"objects": 500 + sets, "types": {"set": sets, "dict": 40}, "tensors": 0,
                   "tensor_bytes": 0},
        "sizes": {"engine.kv_cache._tables": tables, "loop._streams": 0},
        "tracemalloc": [
            {"size_diff": 2048, "count_diff": 3, "where": ["a.py:1", "engine/x.py:12"]}
        ],
    }  # fmt: skip


def test_a_probe_is_summarized_from_the_warm_up_on(tmp_path: Path) -> None:
    mod = report_module()
    lines = [line(1000.0 + 60 * i, 100 + i, 30 + 5 * i, tables=i, sets=i) for i in range(10)]
    path = tmp_path / "memory-7.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"t": 16')  # cut off
    assert len(mod.read_probe(path)) == 10
    text = mod.probe_report(tmp_path, {7: "prefill abc"}, warm_up_s=300.0)
    assert "prefill abc: 10 probe lines; warm at 5.0 min, last 4.0 min later" in text
    rows = {r.split("  ")[1].strip(): r.split()[-3:] for r in text.splitlines() if "MiB" in r}
    assert rows["heap in use MiB (uordblks+hblkhd)"] == ["105.0", "109.0", "+4.0"]
    assert rows["heap free kept MiB (fordblks)"] == ["55.0", "75.0", "+20.0"]
    assert re.search(r"size engine.kv_cache._tables +5 +9$", text, re.M)  # changed
    assert "loop._streams" not in text  # 0 throughout: left out
    assert "most grown types: set +4, dict +0" in text
    assert "traced      +2.0 KiB     +3  engine/x.py:12 <- a.py:1" in text


def test_no_probe_files_is_said(tmp_path: Path) -> None:
    assert "no probe files in" in report_module().probe_report(tmp_path, {}, 0.0)


def test_a_real_probe_line_reads_back(tmp_path: Path) -> None:
    mod = report_module()
    path = tmp_path / "memory-123.jsonl"
    path.write_text(json.dumps(probe_line(lambda: {"x": 1}, None)) + "\n")
    text = mod.probe_report(tmp_path, {}, 0.0)
    assert "pid 123: 1 probe lines" in text and "RSS MiB" in text and "gc objects" in text
