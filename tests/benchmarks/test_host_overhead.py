"""benchmarks/host_overhead.py: a tiny run end to end (its JSON's shape and figures), its help,
its options' checks, and the correction's arithmetic. Whether the figures meet the target is
not checked here: they depend on the machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.benchmarks.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "host_overhead.py"
FIRST_KEYS = ["batch", "host_ms_per_step", "kernels_per_layer"]

needs_fake_cuda = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch"
)


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script(SCRIPT)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@needs_fake_cuda
def test_a_tiny_run_prints_one_row_per_batch_as_json() -> None:
    done = run("--json", "--shape", "tiny", "--layers", "2", "--batches", "1,4",
               "--steps", "3", "--windows", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)  # stdout holds the JSON alone; progress goes to stderr
    assert [row["batch"] for row in rows] == [1, 4]
    for row in rows:
        assert list(row)[:3] == FIRST_KEYS
        figures = [v for k, v in row.items() if k != "batch"]
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in figures), row
        assert row["host_ms_per_step"] > 0 and row["raw_host_ms_per_step"] > 0
        # The eager step of an unfused layer: norms, projections, RoPE, attention, MLP.
        assert row["kernels_per_layer"] >= 8
        assert row["graph_replays_per_step"] == 1  # every timed step replayed a graph
        assert row["device_ops_per_step"] > 0 and row["uploads_per_step"] >= 1
    assert "window" in done.stderr


def test_help_says_what_it_measures() -> None:
    done = run("--help")
    assert done.returncode == 0, done.stderr
    assert "host time per decode step" in done.stdout.lower()
    assert "kernels per layer" in done.stdout.lower()
    for flag in ("--batches", "--steps", "--windows", "--layers", "--shape", "--json"):
        assert flag in done.stdout


def test_options_are_checked(script: ModuleType) -> None:
    assert script.parse_args([]).batches == [1, 64, 256]
    assert script.parse_args(["--batches", "2,8"]).batches == [2, 8]
    for bad in (["--batches", "one"], ["--batches", "0"], ["--steps", "0"],
                ["--steps", "400", "--windows", "5"]):  # fmt: skip
        with pytest.raises(SystemExit):
            script.parse_args(bad)


def test_the_correction_takes_the_rig_off_and_adds_a_launch_per_device_call(
    script: ModuleType,
) -> None:
    cal = script.Calibration(host_s=2e-6, device_s=10e-6, device_low_s=5e-6, device_high_s=20e-6)
    window = script.Window(
        steps=10, cpu_s=0.5, rig_s=0.3, host_dispatches=1000, device_dispatches=2000,
        device_ops=900, uploads=10, replays=10,
    )  # fmt: skip
    # 0.5 s of CPU - 0.3 s in the rig's spans - 1000 x 2 us - 2000 x 10 us + 910 x 5 us
    expected = 0.5 - 0.3 - 0.002 - 0.02 + 910 * script.LAUNCH_US * 1e-6
    assert window.corrected_s(cal) == pytest.approx(expected)
    assert window.corrected_s(cal, cal.device_high_s) < window.corrected_s(cal)
    assert window.rig_cpu_s(cal) == pytest.approx(0.322)
