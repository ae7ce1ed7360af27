"""The fused element-wise ops of a decoder layer on a GPU: Triton kernels, one launch each.

In torch ops a layer's norms, RoPE, KV write and SiLU x mul take ~25 small kernels per layer
(casts, a reduction, multiplies, a cat); with these, a pure-decode layer is 9-10 launches:
add + RMSNorm, QKV GEMM, RoPE + KV write, attention, O GEMM, add + RMSNorm, gate/up GEMM,
SiLU x mul, down GEMM. Each op rounds where the torch code it replaces rounds
(`models/layers.py`, `models/rope.py`): RoPE + KV write and the residual add bit for bit;
the norm (another summation order) and SiLU (another exp) within a few fp32 ulps before the
final rounding (tests/kernels/triton_interp/test_triton_fused*.py).

`gpu_fused_ops_for(x)` is the models' one question: the ops when `x` lives on a GPU and
Triton is there, else None (then the CPU extension or torch ops serve). The Triton modules
are imported on the first GPU call only: a CPU process never imports Triton from here.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RmsNorm(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


class AddRmsNorm(Protocol):
    def __call__(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...


class SiluAndMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RopeAndWriteKV(Protocol):
    def __call__(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class GpuFusedOps:
    """One launch each; semantics in triton_norm.py, triton_activation.py, triton_rope_kv.py."""

    rms_norm: RmsNorm
    add_rms_norm: AddRmsNorm
    silu_and_mul: SiluAndMul
    rope_and_write_kv: RopeAndWriteKV


_lock = threading.Lock()
# "ops": the loaded ops, or None where Triton is missing (tests put stand-ins here).
_state: dict[str, GpuFusedOps | None] = {}


def load_gpu_fused_ops() -> GpuFusedOps | None:
    """The Triton ops, imported once; None without Triton."""
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _import_ops()
        return _state["ops"]


def _import_ops() -> GpuFusedOps | None:
    if importlib.util.find_spec("triton") is None:
        return None
    from kvrelay_kernels import triton_activation, triton_norm, triton_rope_kv

    return GpuFusedOps(
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        silu_and_mul=triton_activation.silu_and_mul,
        rope_and_write_kv=triton_rope_kv.rope_and_write_kv,
    )


def gpu_fused_ops_for(x: torch.Tensor) -> GpuFusedOps | None:
    """The fused ops when `x` (a layer's activations) is on a CUDA device in a float dtype
    they take; None elsewhere. Cheap after the first call: it runs ~10 times per layer."""
    if not x.is_cuda or x.dtype not in _DTYPES:
        return None
    if "ops" not in _state:
        return load_gpu_fused_ops()
    return _state["ops"]
