"""benchmarks/chaos.py: --help, and a 12 s chaos run against the server it starts (about a
minute with the start): the report has every section, at least one kill whose victim was
replaced and served again within 30 s, no leaked block or lease, and greedy streams equal to
their undisturbed runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "chaos.py"


def test_chaos_help() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--minutes", "--every", "--concurrency", "--max-tokens", "--serve-arg"):
        assert flag in out.stdout


def value(report: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}\s+(.+)$", report, re.MULTILINE)
    assert match, f"{label!r} missing from the report:\n{report}"
    return match.group(1).strip()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # its killed worker must serve again within 30 s (Makefile: RUN_SUITE)
def test_chaos_smoke_run(default_model_dir: Path) -> None:
    command = [
        sys.executable, str(SCRIPT), "--minutes", "0.2", "--every", "5", "--max-tokens", "16",
        "--concurrency", "2", "--no-progress",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    report = out.stdout
    assert out.returncode == 0, report + out.stderr
    for section in (" kvrelay chaos ", " requests ", " migration latency, as clients saw it ",
                    " kills ", " verdict "):  # fmt: skip
        assert section in report
    assert value(report, "Leaked KV blocks (must be 0):") == "0"
    assert value(report, "KV leases left (must be 0):") == "0"
    assert value(report, "Failed (broken mid-stream):") == "0"
    assert int(value(report, "Completed:")) > 0
    greedy = re.fullmatch(
        r"yes \((\d+)/(\d+)\)", value(report, "Greedy streams equal to baseline:")
    )
    assert greedy and greedy.group(1) == greedy.group(2) and int(greedy.group(1)) > 0, report
    kills = re.findall(r"^\s+\d+\s+[\d.]+\s+(prefill|decode)\s+\d+\s+([\d.]+)\s+([\d.]+)$",
                       report, re.MULTILINE)  # fmt: skip
    assert kills, report
    assert all(float(serving) <= 30 for _, _, serving in kills), report
    for label in ("P50 largest gap, streams through a kill (ms):",
                  "P50 inter-token gap, undisturbed (ms):"):  # fmt: skip
        assert re.fullmatch(r"\d+|nan", value(report, label)), report
