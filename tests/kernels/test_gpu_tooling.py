"""`make kernels-check`'s parser and binding check, exercised on the CPU so they cannot rot
between lent GPUs (the GPU check's own parts are tested in tests/benchmarks/test_gpu_check.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


PTXAS = """\
ptxas info    : Compiling entry function '_ZN7kvrelay3fooEv' for 'sm_90'
ptxas info    : Function properties for _ZN7kvrelay3fooEv
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 41568 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN7kvrelay3barEv' for 'sm_90'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 400 bytes cmem[0]
"""


def test_kernels_check_parses_ptxas_and_flags_spills(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    check = _load(ROOT / "kernels" / "csrc" / "check_kernels.py")

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=PTXAS)

    monkeypatch.setattr(check.subprocess, "run", fake_run)
    _, kernels, error = check.compile_one(tmp_path / "x.cu", "sm_90", tmp_path)
    assert error == ""
    assert [(k.registers, k.smem, k.spill) for k in kernels] == [(255, 41568, 12), (32, 0, 0)]


def test_binding_check_stands_in_only_for_headers_the_cuda_folder_lacks(tmp_path: Path) -> None:
    check = _load(ROOT / "kernels" / "csrc" / "check_binding.py")
    cuda = tmp_path / "cuda"
    (cuda / "c10" / "cuda" / "impl").mkdir(parents=True)
    (cuda / "cublas_v2.h").write_text("// the real one\n")
    stubs = tmp_path / "stubs"
    written = check.write_stubs(stubs, cuda)
    assert "cublas_v2.h" not in written and not (stubs / "cublas_v2.h").exists()
    assert {"cusparse.h", "c10/cuda/impl/cuda_cmake_macros.h"} <= set(written)
    assert "typedef int cusparseStatus_t;" in (stubs / "cusparse.h").read_text()
    command = check.compile_command(cuda, stubs)
    # The stand-ins are searched after every real folder, so a real header always wins.
    assert command[-2] == f"-idirafter{stubs}" and f"-I{cuda}" in command
    assert "-fsyntax-only" in command and check.STANDARD in command


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc's CUDA headers")
def test_binding_check_fails_on_a_binding_torch_would_not_build(tmp_path: Path) -> None:
    """`make kernels-check` compiles the real binding; this proves that check can fail."""
    check = _load(ROOT / "kernels" / "csrc" / "check_binding.py")
    broken = tmp_path / "torch_binding.cpp"
    text = check.BINDING.read_text()
    assert "c10::cuda::CUDAGuard guard" in text
    broken.write_text(text.replace("c10::cuda::CUDAGuard guard", "c10::cuda::NoSuchGuard guard"))
    include = check.cuda_include_of(Path(shutil.which("nvcc") or "nvcc"))
    assert (include / "cuda_runtime_api.h").is_file()
    passed, output = check.check_binding(include, source=broken)
    assert not passed and "NoSuchGuard" in output


def _compiling(script: list[str]) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh Python without TRITON_INTERPRET: this session's interpreter tests
    set it, and an interpreted kernel cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *script], capture_output=True, text=True, check=False, env=env, cwd=ROOT
    )


def test_triton_kernels_compile_for_a_gpu_at_the_engines_constants() -> None:
    """No GPU: Triton compiles to a cubin with its own ptxas (its interpreter never does)."""
    done = _compiling(
        [str(ROOT / "kernels" / "csrc" / "check_triton.py"), "--arch", "90", "--quick"]
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if " sm_90 " in line]
    kernels = {"paged_attention", "write_kv", "rms_norm", "add_rms_norm", "silu_and_mul"}
    kernels |= {"rope_and_write_kv", "sample_rows"}
    assert {row[0] for row in rows} == kernels
    for row in rows:  # kernel, config..., arch, regs, smem, spill, seconds
        registers, spill = int(row[-4]), int(row[-2])
        assert 0 < registers <= 255 and spill == 0
    assert f"{len(kernels)} compiled; 0 errors; 0 spilling" in done.stdout


BROKEN_KERNEL = """
import sys
import triton
import triton.language as tl

sys.path.insert(0, {csrc!r})
import check_triton as check


@triton.jit
def kernel(x_ptr):
    tl.store(x_ptr, tl.no_such_function(1.0))


signature = check.signature(kernel, {{"x_ptr": "*fp32"}}, set(), {{}})
case = check.Case("broken", "fp32", 90, kernel, signature, {{}}, 1)
print(check.compile_case(case).error)
"""


def test_triton_check_reports_a_kernel_that_does_not_compile(tmp_path: Path) -> None:
    script = tmp_path / "broken_kernel.py"  # triton.jit reads the kernel's source file
    script.write_text(BROKEN_KERNEL.format(csrc=str(ROOT / "kernels" / "csrc")))
    done = _compiling([str(script)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no_such_function" in done.stdout
