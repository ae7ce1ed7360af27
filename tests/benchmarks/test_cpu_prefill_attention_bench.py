"""benchmarks/cpu_prefill_attention.py runs end to end on a tiny shape and refuses bad --shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay_kernels import cpu_prefill
from tests.benchmarks.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_prefill_attention.py"


def test_shapes_parse_and_bad_ones_say_the_form() -> None:
    bench = load_script(SCRIPT)
    assert bench.parse_shapes("128, 64x640") == [(128, 128), (64, 640)]
    for bad in ("128by640", "640x128", "0", "x5"):
        with pytest.raises(SystemExit, match="PROMPTxCONTEXT"):
            bench.parse_shapes(bad)


@pytest.mark.skipif(cpu_prefill.load_extension() is None, reason="the kernel does not build here")
def test_it_prints_one_row_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script(SCRIPT)
    argv = ["--shapes", "20,8x70", "--repeats", "2", "--threads", "1", "--layers", "3"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for shape in ("| 20 x 20 ", "| 8 x 70 "):
        rows = [line for line in out.splitlines() if line.startswith(shape)]
        assert [row.split("|")[2].strip() for row in rows] == ["float32", "bfloat16"]
        for row in rows:
            kernel, ref, ratio, total, ref_total = (cell.strip() for cell in row.split("|")[3:8])
            assert ratio.endswith("x") and float(ratio[:-1]) > 0
            assert float(kernel) > 0 and float(ref) > 0
            assert float(total) == pytest.approx(float(kernel) * 3 / 1e3, abs=0.06)
            assert float(ref_total) > 0
