"""A decoder layer's element-wise steps in one C++ call each on the CPU (csrc_cpu/
fused_layer_ops.cpp): RMSNorm, the residual add fused with the norm after it, RoPE, and the
MLP's SiLU-and-multiply.

The models call these when `fused_ops_for` says the tensors qualify (CPU, fp32 or bf16) and the
extension builds; otherwise they run their torch code, which these match (bit for bit in RoPE
and SiLU-and-multiply; norms up to the order of one fp32 sum).
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvrelay_kernels.cpu_extension import load_cpu_extension

# No fast-math and no FMA contraction: the results must round exactly as torch's ops do.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
_DTYPES = (torch.float32, torch.bfloat16)


def load_fused_ops() -> ModuleType | None:
    """The compiled module, built on the first call; None where it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_fused_ops", "fused_layer_ops.cpp", _FLAGS, "fused CPU layer ops"
    )


def prepare_fused_ops(device: torch.device | str) -> None:
    """Build the extension now when the engine runs on `device` and it will be used there: a
    server builds it before it is ready, so its first request does not wait for a compile
    (~30 s on a new CPU or a new kvrelay version)."""
    if torch.device(device).type == "cpu":
        load_fused_ops()


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The fused ops when `x` (a layer's activations) can take them: None on other devices,
    in other dtypes, or where the extension cannot be built."""
    # `is_cpu`, not `device.type`: this runs ~150 times a step, and building the device object
    # costs 0.7 us a call where the flag costs 0.2.
    if not x.is_cpu or x.dtype not in _DTYPES:
        return None
    return load_fused_ops()
