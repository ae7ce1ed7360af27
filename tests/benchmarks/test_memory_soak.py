"""benchmarks/memory_soak.py: --help, the verdict rule on made-up samples, and a short smoke run
against the session's server whose report has the RSS table (serve, prefill and decode worker
columns), the growth section and a verdict for every process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks import scripts
from tests.servers import ServerProcess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "memory_soak.py"


def load_script() -> ModuleType:
    return scripts.load_script(SCRIPT)


def test_memory_soak_help() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--minutes", "--concurrency", "--sample-s", "--url", "--server-log",
                 "--warm-up-min", "--max-mib-per-hour", "--probe", "--probe-s"):  # fmt: skip
        assert flag in out.stdout


def test_verdict_rule() -> None:
    soak = load_script()
    # 0.2 MiB a minute is 12 MiB an hour: over issue 41's 10.
    linear = [soak.Sample(60.0 * i, i, {"p": 100.0 + 0.2 * i}) for i in range(30)]
    grows = soak.growth(linear, "p", 300.0, 10.0)
    assert grows.verdict == "growing"
    assert (grows.start_mib, grows.warm_mib) == (100.0, pytest.approx(101.0))
    assert grows.end_mib == pytest.approx(105.8)
    assert grows.slope_mib_per_hour == pytest.approx(12.0)
    # Fast growth during the warm-up, then flat: flat (the warm-up is left out).
    warming = [soak.Sample(60.0 * i, i, {"p": 100.0 + 10 * min(i, 5)}) for i in range(30)]
    flat = soak.growth(warming, "p", 300.0, 10.0)
    assert flat.verdict == "flat" and flat.slope_mib_per_hour == pytest.approx(0.0)
    # The same growth counted from the start would not pass.
    assert soak.growth(warming, "p", 0.0, 10.0).verdict == "growing"
    assert soak.growth(linear[:7], "p", 300.0, 10.0).verdict == "too short to tell"
    assert soak.growth(linear, "q", 300.0, 10.0).verdict == "no samples"


def test_ray_processes_are_labelled_and_reported_each() -> None:
    soak = load_script()
    assert soak.ray_label("ray::EngineWorker.prefill") == "ray::EngineWorker"
    assert soak.ray_label("ray::DashboardAgent") == "ray::DashboardAgent"
    assert soak.ray_label("python -u log_monitor.py session_x") == "ray log_monitor.py"
    assert soak.ray_label("python dashboard.py --host=127.0.0.1") == "ray dashboard.py"
    assert soak.ray_label("gcs_server logs --config_list=e30") == "ray gcs_server"
    assert soak.ray_label("") == "ray ?"
    samples = [
        soak.Sample(60.0 * i, i, {"serve": 400.0, "ray other (sum)": 150.0 + i},
                    {"ray dashboard.py": 100.0 + i, "ray gcs_server": 50.0})
        for i in range(12)
    ]  # fmt: skip
    args = soak.parse_args(["--warm-up-min", "5"])
    report = soak.format_report(samples, soak.Counts(), args)
    rows = {line.split()[-2] if "ray" not in line else line.strip().split("  ")[0]: line
            for line in report.splitlines() if line.endswith(("flat", "growing"))}  # fmt: skip
    assert rows["ray dashboard.py"].split()[-2:] == ["60.0", "growing"]  # 1 MiB a minute
    assert rows["ray gcs_server"].split()[-2:] == ["0.0", "flat"]
    assert report.index("ray other (sum)") < report.index("  ray dashboard.py")


def test_bad_flags_are_refused_by_name() -> None:
    for flags, name in (
        (["--warm-up-min", "-1"], "--warm-up-min"),
        (["--max-mib-per-hour", "-2"], "--max-mib-per-hour"),
        (["--probe-s", "0"], "--probe-s"),
        (["--probe", "/tmp/x", "--url", "http://127.0.0.1:1"], "--probe"),
    ):
        out = subprocess.run(
            [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and name in out.stderr, out.stderr


def test_worker_roles_from_the_log(tmp_path: Path) -> None:
    soak = load_script()
    log = tmp_path / "serve.log"
    log.write_text(
        "WARNING worker 1a2b3c4d5e6f (prefill, pid 4242) joined\n"
        "WARNING worker abcdefabcdef (decode, pid 4343) joined\n"
    )
    assert soak.worker_roles(log) == {4242: "prefill 1a2b3c4d5e6f", 4343: "decode abcdefabcdef"}


@pytest.mark.e2e
@pytest.mark.slow
def test_memory_soak_smoke_run(kvrelay_server: ServerProcess) -> None:
    # The session server admits 4 requests at once and queues 2: two clients fit.
    command = [
        sys.executable, str(SCRIPT), "--url", kvrelay_server.http_url,
        "--server-log", str(kvrelay_server.log_path), "--minutes", str(20 / 60),
        "--sample-s", "4", "--concurrency", "2", "--no-progress", "--warm-up-min", "0",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    report = out.stdout
    assert out.returncode == 0, report + out.stderr
    for section in (" kvrelay memory soak ", " RSS (MiB) over time ", " growth (MiB) "):
        assert section in report
    header = next(line for line in report.splitlines() if line.lstrip().startswith("min"))
    assert re.search(r"\bserve\b", header) and "prefill " in header and "decode " in header
    rows = [line for line in report.splitlines() if re.match(r"^\s*\d+\.\d\s+\d+\s", line)]
    assert len(rows) >= 5, report  # a sample at 0 s, every 4 s, and at the end
    # minutes, requests, then serve, decode, prefill and Ray's other processes
    assert all(len(row.split()) == 6 for row in rows), report
    verdicts = re.findall(r"^(\S+)[^\n]*(flat|growing|too short to tell)$", report, re.M)
    # serve, prefill, decode, Ray's other processes; then Ray's own, indented
    assert [v[0] for v in verdicts][:4] == ["serve", "decode", "prefill", "ray"], report
    assert re.search(r"^requests: .*\bok [1-9]", report, re.M), report
