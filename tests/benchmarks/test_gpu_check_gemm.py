"""gpu_check part 5 (benchmarks/gpu_parts/gemm_bench.py) on the CPU: the cases' shapes, bytes
and FLOPs, the fastest method, the summary rows from made-up timings, the time budget's cut-off,
a failing or wrong method being n/a and not a crash, the preferred BLAS library restored, the
Triton matmul under the interpreter (a subprocess: TRITON_INTERPRET is read when triton loads)
and the script's dry run of this part alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PART = "5 gemm"
DRY_RUN_ARGS = ("--dry-run", "--parts", "gemm", "--out")


@pytest.fixture(scope="module")
def gemm() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    from gpu_parts import gemm_bench

    yield gemm_bench


@pytest.fixture(scope="module")
def report() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    from gpu_parts import report

    return report


def env_without_interpreter(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), str(ROOT / "kernels")])
    return {**env, **extra}


def test_the_engine_shapes_matmuls(gemm: ModuleType) -> None:
    from gpu_parts.engine_models import SHAPES

    dims = {name: gemm.matmul_dims(cfg) for name, cfg in SHAPES.items()}
    assert dims["smollm2-135m"] == {
        "qkv": (15 * 64, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "vocab": (49152, 576),
    }
    assert dims["llama-1b-hd128"] == {
        "qkv": (32 * 128, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "vocab": (32000, 2048),
    }
    cases = gemm.plan_cases(SHAPES, gemm.M_VALUES)
    assert len(cases) == 2 * 5 * 9
    assert [c.m for c in cases[:10]] == [1] * 10 and cases[-1].m == 256  # small M first
    assert cases[0].model == "135M" and cases[5].model == "1B"


def test_bytes_flops_percent_and_tflops(gemm: ModuleType) -> None:
    case = gemm.Case("1B", "down", 4, 2048, 8192)
    assert case.nbytes(2) == (2048 * 8192 + 4 * 8192 + 4 * 2048) * 2
    assert case.flops() == 2 * 4 * 2048 * 8192
    assert case.tag == "1B down M=4"
    r = gemm.Result(case, us={"default": 10.0})
    gbps = case.nbytes(2) / 10e-6 / 1e9
    assert r.pct("default", 4000.0, 2) == pytest.approx(100 * gbps / 4000.0)
    assert r.tflops("default") == pytest.approx(case.flops() / 10e-6 / 1e12)
    assert r.pct("cublaslt", 4000.0, 2) is None and r.tflops("triton") is None


def test_the_fastest_method(gemm: ModuleType) -> None:
    assert gemm.winner({}) is None
    assert gemm.winner({"default": 5.0, "cublaslt": 4.0, "triton": 6.0}) == "cublaslt"
    assert gemm.winner({"triton": 5.0, "cublaslt": 5.0, "default": 5.0}) == "default"  # tie
    assert gemm.winner({"triton": 5.0, "cublaslt": 5.0}) == "cublaslt"


def result(gemm: ModuleType, model: str, m: int, **pct: float) -> Any:
    """A case (N = K = 512, bf16) whose methods ran at these % of a 1000 GB/s copy bandwidth."""
    case = gemm.Case(model, "o", m, 512, 512)
    us = {name: case.nbytes(2) / (p / 100 * 1000e9) * 1e6 for name, p in pct.items()}
    return gemm.Result(case, us=us)


def rows_by_check(rows: list[Any]) -> dict[str, Any]:
    return {r.check: r for r in rows}


def test_summary_rows_from_fake_results(gemm: ModuleType) -> None:
    results = [
        result(gemm, "1B", 1, default=80, cublaslt=90),
        result(gemm, "1B", 2, default=90, cublaslt=90),
        result(gemm, "1B", 4, default=50, cublaslt=80, triton=90),
        result(gemm, "1B", 32, default=20, cublaslt=10),  # M > 16: not in the median
        result(gemm, "135M", 1, default=50),
    ]
    results[2].errors["triton"] = "RuntimeError: boom"
    del results[2].us["triton"]
    results[1].us["triton"] = results[1].us["default"] / 2
    skipped = {"matmul": "same aten ops"}
    rows = rows_by_check(gemm.summary_rows(results, 6, 1000.0, 2, True, skipped, "copy bw x"))
    cases = rows["cases measured"]
    assert (cases.status, cases.value) == ("PASS", "5/6") and "time budget" in cases.note
    bw = rows["1B GEMMs at M<=16: weight-read bandwidth"]
    assert (bw.status, bw.value, bw.target) == ("PASS", "median 80% of copy bw", ">= 70%")
    assert bw.note == "3 cases; min 50% (1B o M=4), max 90% (1B o M=2)"
    low = rows["135M GEMMs at M<=16: weight-read bandwidth"]
    assert (low.status, low.value) == ("MISS", "median 50% of copy bw")
    lt = rows["1B cuBLASLt faster than default"]
    assert (lt.status, lt.value) == ("PASS", "2/4 cases")
    assert lt.note == (
        "default faster or equal in 2; largest gain 1.60x (1B o M=4); "
        "fastest of all: default 1, cublaslt 2, triton 1"
    )
    assert rows["135M cuBLASLt faster than default"].status == "SKIP"
    assert rows["torch.matmul(x, W.t()) vs F.linear"].note == "same aten ops"
    triton = rows["Triton matmul (gemm_triton.py)"]
    assert (triton.status, triton.value) == ("MISS", "ran 1/5, fastest in 1")
    assert triton.note == "1B o M=4: RuntimeError: boom"


def test_summary_rows_on_a_cpu_and_with_a_broken_default(gemm: ModuleType) -> None:
    ok, broken = result(gemm, "1B", 1, default=50), result(gemm, "1B", 2)
    broken.errors["default"] = "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED"
    skipped = {"cublaslt": "no CUDA device", "matmul": "same", "triton": "no CUDA device"}
    rows = rows_by_check(gemm.summary_rows([ok, broken], 2, 10.0, 4, False, skipped, ""))
    cases = rows["cases measured"]
    assert cases.status == "FAIL" and "1B o M=2: RuntimeError" in cases.note
    bw = rows["1B GEMMs at M<=16: weight-read bandwidth"]
    assert bw.status == "SKIP" and bw.value.startswith("CPU: median")
    assert rows["1B cuBLASLt faster than default"].note == "no CUDA device"
    assert rows["Triton matmul (gemm_triton.py)"].status == "SKIP"
    assert gemm.summary_rows([], 90, 10.0, 2, True, skipped, "")[0].status == "FAIL"


def test_measuring_stops_when_the_time_share_is_spent(gemm: ModuleType, report: ModuleType) -> None:
    now = [0.0]
    deadline = report.Deadline(10.0, clock=lambda: now[0])
    logged: list[str] = []

    def bench(case: Any) -> Any:
        now[0] += 4.0
        return gemm.Result(case, us={"default": 1.0})

    planned = [gemm.Case("1B", "o", m, 64, 64) for m in gemm.M_VALUES]
    results = gemm.measure(planned, deadline, bench, logged.append)
    assert [r.case.m for r in results] == [1, 2, 4]  # started at 0, 4 and 8 s
    assert logged == ["time budget spent: 6/9 cases left out"]
    row = gemm.cases_row(results, len(planned), "")
    assert row.value == "3/9" and "largest M left out" in row.note


def test_a_failing_or_wrong_method_is_na_for_the_case(gemm: ModuleType) -> None:
    def raises(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("first line\nno kernel image is available")

    calls = {
        "default": gemm.CALLS["default"],
        "matmul": lambda x, w: torch.matmul(x, w.t()) + 1.0,  # wrong
        "triton": raises,
    }
    bench = gemm.Bench("cpu", torch.float32, ["default", "matmul", "triton"], calls)
    r = bench(gemm.Case("1B", "o", 3, 40, 24))
    assert set(r.us) == {"default"} and r.us["default"] > 0
    assert r.errors["triton"] == "RuntimeError: no kernel image is available"
    assert r.errors["matmul"].startswith("ValueError: wrong result: max error")
    table = gemm.full_table([r], 10.0, 4)
    assert "| 1B | o | 3 | 40 | 24 |" in table and "| n/a |" in table and "| - |" in table
    assert table.splitlines()[-1].endswith("| default |  |")
    compact = gemm.compact_table([r], 10.0, 4)
    assert compact.splitlines()[-1].split()[:2] == ["1B", "o"]
    assert compact.splitlines()[-1].endswith("d")


def test_the_preferred_blas_library_is_restored(
    gemm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = ["cublas"]

    def preferred(backend: str | None = None) -> str:
        if backend is not None:
            state[0] = backend
        return state[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    with gemm.blas_library("cublaslt"):
        assert state == ["cublaslt"]
    assert state == ["cublas"]
    with pytest.raises(RuntimeError), gemm.blas_library("cublaslt"):
        raise RuntimeError("a method failed")
    assert state == ["cublas"]


def test_matmul_is_skipped_when_it_dispatches_like_linear(gemm: ModuleType) -> None:
    same, ops = gemm.matmul_dispatch("cpu", torch.float32)
    assert same and "aten.mm" in ops


TRITON_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {bench!r})
    from gpu_parts import gemm_bench, gemm_triton
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for m, n, k in [(1, 33, 17), (16, 64, 128), (17, 70, 130), (130, 40, 24)]:
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            out = gemm_triton.matmul(x, w)
            assert out.dtype == dtype, out.dtype
            assert gemm_bench.close_enough(out, torch.nn.functional.linear(x, w)) == "", (m, n, k)
    bench = gemm_bench.Bench("cpu", torch.float32, ["default", "triton"], gemm_bench.CALLS)
    r = bench(gemm_bench.Case("1B", "qkv", 2, 48, 32))
    assert set(r.us) == {{"default", "triton"}}, r.errors
    print("ok")
""")


def test_the_triton_matmul_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT.format(bench=str(BENCH))],
        env=env_without_interpreter(TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_dry_run_of_part_5(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), *DRY_RUN_ARGS, str(tmp_path)],
        env=env_without_interpreter(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [re.split(r"\s{2,}", line) for line in proc.stdout.splitlines() if line.startswith(PART)]
    checks = {r[1]: r for r in rows}
    assert checks["cases measured"][2:4] == ["PASS", "30/30"]
    for label in ("135M", "1B"):
        bw = checks[f"{label} GEMMs at M<=16: weight-read bandwidth"]
        assert bw[2] == "SKIP" and bw[3].startswith("CPU: median") and bw[4] == ">= 70%"
        assert checks[f"{label} cuBLASLt faster than default"][2:] == ["SKIP", "no CUDA device"]
    assert "same aten ops" in checks["torch.matmul(x, W.t()) vs F.linear"][-1]
    assert checks["Triton matmul (gemm_triton.py)"][2] == "SKIP"
    assert {r[2] for r in rows} <= {"PASS", "SKIP"}
    assert re.search(r"^1B\s+vocab\s+\S+d\s+\S+d\s+\S+d$", proc.stdout, re.M)  # compact table
    text = (tmp_path / "gemm_bench.md").read_text()
    assert "| model | matmul | M | N | K | default us |" in text
    assert len([line for line in text.splitlines() if line.startswith(("| 135M", "| 1B"))]) == 30
