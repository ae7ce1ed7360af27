"""benchmarks/cpu_attention.py runs end to end on a tiny shape and refuses bad --shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay_kernels import cpu_backend
from tests.benchmarks.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_attention.py"


def test_shapes_parse_and_bad_ones_say_the_form() -> None:
    bench = load_script(SCRIPT)
    assert bench.parse_shapes("16x1024, 1x8") == [(16, 1024), (1, 8)]
    with pytest.raises(SystemExit, match="SEQSxCONTEXT"):
        bench.parse_shapes("16by1024")


@pytest.mark.skipif(not cpu_backend.is_available(), reason="the CPU kernel does not build here")
def test_it_prints_one_row_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script(SCRIPT)
    argv = ["--shapes", "2x40", "--repeats", "2", "--threads", "1", "--layers", "3"]
    assert bench.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 x 40")]
    assert [row.split("|")[2].strip() for row in rows] == ["float32", "bfloat16"]
    for row in rows:
        kernel, ref, ratio, rate, cached = (cell.strip() for cell in row.split("|")[3:8])
        assert ratio.endswith("x") and float(ratio[:-1]) > 0
        assert float(kernel) > 0 and float(ref) > 0 and float(rate) > 0 and float(cached) > 0


def test_bad_variant_flags_say_the_flag() -> None:
    bench = load_script(SCRIPT)
    for argv, flag in (
        (["--sliding-window", "0"], "--sliding-window"),
        (["--soft-cap", "-1"], "--soft-cap"),
    ):
        with pytest.raises(SystemExit, match=flag):
            bench.main(argv)


def test_the_read_rate_counts_the_window_only() -> None:
    bench = load_script(SCRIPT)
    assert bench.keys_read(4096, None) == 4096
    assert bench.keys_read(4096, 256) == 256
    assert bench.keys_read(100, 256) == 100


@pytest.mark.skipif(not cpu_backend.is_available(), reason="the CPU kernel does not build here")
def test_a_windowed_capped_run_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script(SCRIPT)
    argv = ["--shapes", "2x40", "--repeats", "1", "--threads", "1", "--layers", "2"]
    assert bench.main([*argv, "--sliding-window", "8", "--soft-cap", "5"]) == 0
    out = capsys.readouterr().out
    assert "sliding window: 8, soft cap: 5.0" in out
    assert len([line for line in out.splitlines() if line.startswith("| 2 x 40")]) == 2
