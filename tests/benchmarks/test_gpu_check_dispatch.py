"""gpu_check's decode dispatch report on the CPU: part 2's table per model from its CUDA and
Triton times, the row for the kernel the dispatch serves at the large shapes, and the head's
lines for the tables the engines made at load."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvrelay_kernels import decode_dispatch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def modules() -> dict[str, ModuleType]:
    sys.path.insert(0, str(BENCH))
    import gpu_check
    from gpu_parts import decode_bench, report

    return {"check": gpu_check, "bench": decode_bench, "report": report}


@pytest.fixture(autouse=True)
def no_tables() -> Iterator[None]:
    decode_dispatch.clear()
    yield
    decode_dispatch.clear()


def result(bench: ModuleType, model: str, batch: int, context: int, pcts: dict[str, float]) -> Any:
    """A part 2 result whose kernels ran at `pcts` % of a 1 GB/s copy bandwidth (bf16)."""
    heads, kv_heads, dim = bench.MODELS[model]
    shape = bench.Shape(model, heads, kv_heads, dim, batch, context)
    us = {m: shape.kv_bytes(2) / (pct / 100 * 1e9) * 1e6 for m, pct in pcts.items()}
    return bench.Result(shape, us=us)


def test_the_dispatch_table_is_made_per_model_from_the_cuda_and_triton_times(
    modules: dict[str, ModuleType],
) -> None:
    bench = modules["bench"]
    results = [
        result(bench, "llama8b", 1, 512, {"cuda": 60, "triton": 30, "sdpa": 90}),
        result(bench, "llama8b", 64, 2048, {"cuda": 45, "triton": 90}),
        result(bench, "smollm2", 64, 2048, {"cuda": 50}),  # Triton failed there
    ]
    tables = bench.dispatch_tables(results, torch.bfloat16)
    assert set(tables) == {"llama8b", "smollm2"}
    llama = tables["llama8b"]
    assert llama.cells == {(1, 512): "cuda", (64, 2048): "triton"}  # sdpa is not a choice
    assert llama.shape.num_heads == 32 and llama.shape.dtype == torch.bfloat16
    assert tables["smollm2"].cells == {}  # no shape timed for both: the CUDA kernel


def test_the_served_kernel_row_passes_or_misses_on_the_large_shapes(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    bench, report = modules["bench"], modules["report"]
    ctx = report.Context("cuda", small=False, work_dir=tmp_path, out_dir=tmp_path)
    fast = [
        result(bench, "llama8b", 64, 2048, {"cuda": 45, "triton": 90}),
        result(bench, "llama8b", 1, 512, {"cuda": 20, "triton": 10}),  # small: not checked
    ]
    (row,) = bench.dispatch_rows(ctx, fast, 1.0, 2, torch.bfloat16)
    assert row.status == "PASS" and row.value == "min 90% (llama8b b64 c2048)"
    written = (tmp_path / "decode_dispatch.md").read_text()
    assert "b64/c2048=triton" in written and "(kernel, then CUDA/Triton us)" in written
    slow = [result(bench, "llama8b", 256, 8192, {"cuda": 50, "triton": 70})]
    (row,) = bench.dispatch_rows(ctx, slow, 1.0, 2, torch.bfloat16)
    assert row.status == "MISS" and row.value == "min 70% (llama8b b256 c8192)"


def test_without_cuda_or_triton_times_the_row_is_skipped(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    bench, report = modules["bench"], modules["report"]
    cpu = report.Context("cpu", small=True, work_dir=tmp_path)
    sdpa_only = [result(bench, "smollm2", 1, 64, {"sdpa": 10})]
    (row,) = bench.dispatch_rows(cpu, sdpa_only, 1.0, 4, torch.float32)
    assert row.status == "SKIP" and row.note == "no CUDA device"
    gpu = report.Context("cuda", small=False, work_dir=tmp_path)
    small = [result(bench, "llama8b", 1, 512, {"cuda": 20, "triton": 10})]
    (row,) = bench.dispatch_rows(gpu, small, 1.0, 2, torch.bfloat16)
    assert row.status == "SKIP" and row.note == "no such shape timed for both kernels"


def test_the_report_head_names_the_tables_the_engines_made(
    modules: dict[str, ModuleType],
) -> None:
    check = modules["check"]
    assert check.dispatch_lines() == [
        "decode dispatch at load: no table (no engine on the cuda backend ran)"
    ]
    shape = decode_dispatch.DecodeShape(9, 3, 64, torch.bfloat16, 16, False, False)
    decode_dispatch.install(decode_dispatch.DecodeTable(shape, "cuda", "pinned"))
    assert check.dispatch_lines() == [
        "at load, decode attention (9/3 heads x 64 bfloat16, block 16): pinned, cuda for every step"
    ]
