"""`make test` runs the suite in two phases: the parallel run (pytest-xdist) without the tests
marked `alone`, then those by themselves, since their wall-time bounds (/health within 1 s
under fuzzing, a killed worker serving again within 30 s) would measure the other worker's
load on a 2-core machine rather than kvrelay."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _suite_commands() -> list[str]:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "pytest"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [line for line in out.stdout.splitlines() if "bin/pytest" in line]


def test_the_parallel_run_leaves_the_alone_tests_to_a_run_by_themselves() -> None:
    parallel, alone = _suite_commands()
    assert re.search(r" -n \S+ --dist loadfile -m \"not alone\"$", parallel), parallel
    assert alone.endswith(" -m alone") and " -n " not in alone, alone


def test_the_wall_time_bounded_tests_are_marked_alone() -> None:
    fuzz_guarded = sorted(
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests" / "fuzz").glob("test_*.py")
        if "guarded(" in path.read_text()
    )
    assert fuzz_guarded, "no fuzz test uses the /health guard any more: update this test"
    expected = {
        *fuzz_guarded,
        "tests/chaos/test_chaos.py",
        "tests/benchmarks/test_chaos_bench.py",
        "tests/worker/test_ray_listeners.py",
    }
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "alone", *sorted(expected)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == expected
