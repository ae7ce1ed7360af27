"""benchmarks/scheduler_step.py: a tiny run end to end (its JSON's rows), its table and the
served threshold it prints. Whether the reads pay off is not checked here: it depends on the
machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvrelay.engine import plain_decodes

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "scheduler_step.py"


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout


def test_json_rows_give_both_sides_per_batch() -> None:
    rows = json.loads(run("--batches", "2,8", "--steps", "3", "--windows", "2", "--json"))
    assert [r["batch"] for r in rows] == [2, 8]
    for r in rows:
        assert r["us_per_step_on"] > 0 and r["us_per_step_off"] > 0
        assert abs(r["ratio"] - r["us_per_step_on"] / r["us_per_step_off"]) < 1e-9


def test_the_table_names_the_served_threshold() -> None:
    out = run("--batches", "4", "--steps", "2", "--windows", "1")
    assert "| 4 |" in out
    assert f"plain_decodes.MIN_ROWS = {plain_decodes.MIN_ROWS} requests" in out
