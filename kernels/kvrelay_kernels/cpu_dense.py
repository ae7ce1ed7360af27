"""Few-row dense matmuls on the CPU (csrc_cpu/dense_gemv.cpp): a decode step's handful of rows
times a row-major weight, streamed once at memory speed where oneDNN's packed kernels are
compute-bound (bf16 on AVX512-BF16, fp32 on AVX-512).

`kvrelay.models.layers.Linear` takes this path for up to `GEMV_MAX_ROWS[dtype]` rows where
the kernel builds for the weight's dtype; oneDNN (or `linear`) otherwise.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvrelay_kernels.cpu_extension import load_cpu_extension

# Multiply-adds fused; no fast-math (the sums' order is the kernel's, not the compiler's).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# Up to this many rows the kernel beats oneDNN's packed matmul, per dtype. The default
# model's 120 matmuls, a step's worth, on a 2-core Zen 4 EPYC (`benchmarks/few_row_matmul.py`;
# ms, kernel / packed): bf16 6.0 / 16.8 at 1 row, 9.3 / 17.0 at 2, 12.5 / 16.3 at 4, 17.5 /
# 18.6 at 8, 27.3 / 22.0 at 16; fp32 16.1 / 26.6, 15.0 / 28.7, 23.2 / 24.0, 41.9 / 32.4 at 8
# (past 4 fp32 rows the kernel's multiply-adds, not the weight's bytes, bound it).
GEMV_MAX_ROWS = {torch.bfloat16: 8, torch.float32: 4}


def load_dense_gemv_ops() -> ModuleType | None:
    """The compiled module (`dense_gemv`, `supports`, `k_multiple`), built on the first call;
    None where it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_dense_gemv", "dense_gemv.cpp", _FLAGS, "CPU few-row dense matmul"
    )


def dense_gemv_for(weight: torch.Tensor) -> ModuleType | None:
    """The module when its kernel takes `weight` (`[out, in]` on the CPU, a dtype this build
    has a kernel for, in-features a multiple of its step); None otherwise."""
    name = _DTYPE_NAMES.get(weight.dtype)
    if name is None or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    module = load_dense_gemv_ops()
    if module is None or not module.supports(name):
        return None
    if weight.shape[1] % module.k_multiple(name) != 0:
        return None
    return module
