"""benchmarks/fuzz_soak.py: --help, and a 20 s smoke run against the session's server whose
report has every section, no 5xx or other server-side failure, and equal victim runs."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import ServerProcess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "fuzz_soak.py"


def test_fuzz_soak_help() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--minutes", "--concurrency", "--hostile-concurrency", "--url", "--grpc-target"):
        assert flag in out.stdout


def value(report: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}\s+(.+)$", report, re.MULTILINE)
    assert match, f"{label!r} missing from the report:\n{report}"
    return match.group(1).strip()


@pytest.mark.e2e
@pytest.mark.slow
def test_fuzz_soak_smoke_run(kvrelay_server: ServerProcess) -> None:
    # The session server admits 4 requests at once: victim + 1 stream + 2 hostile clients.
    command = [
        sys.executable, str(SCRIPT), "--url", kvrelay_server.http_url,
        "--grpc-target", kvrelay_server.grpc_target, "--minutes", str(20 / 60),
        "--concurrency", "1", "--hostile-concurrency", "2", "--no-progress",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=180)
    report = out.stdout
    assert out.returncode == 0, report + out.stderr
    for section in (" kvrelay fuzz soak ", " requests by outcome ", " verdict ", " RSS (MiB) "):
        assert section in report
    assert value(report, "5xx responses (must be 0):") == "0"
    assert value(report, "All server-side failures (must be 0):") == "0"
    equal = re.fullmatch(r"yes \((\d+)/(\d+)\)", value(report, "Victim runs equal to baseline:"))
    assert equal and equal.group(1) == equal.group(2) and int(equal.group(1)) >= 2, report
    # Hostile traffic was sent and answered: 400s and gRPC INVALID_ARGUMENTs at least.
    assert int(value(report, "HTTP 400:")) > 0 and int(value(report, "gRPC INVALID_ARGUMENT:")) > 0
    ratio = float(value(report, "P99 ITL ratio (hostile / clean):"))
    assert math.isfinite(ratio) and ratio > 0
    # The server process itself (found from its port) is in the RSS table, start and end.
    row = re.search(rf"^\s*{kvrelay_server.process.pid}\s+.*?(\d+)\s+(\d+)$", report, re.M)
    assert row and int(row.group(1)) > 0 and int(row.group(2)) > 0, report
