"""Every decoder layer of an all-decode CPU step in one C++ call (csrc_cpu/decoder_stack.cpp).

The stack calls the other CPU extensions' kernels (the blocked and GGUF-block matmuls, fused
norms, RoPE and SiLU, decode attention and the KV write) straight from C++, through the entry
points they export (csrc_cpu/kernel_api.h); `kvrelay.models.decoder_stack` binds a model's
weights to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kvrelay_kernels import cpu_backend
from kvrelay_kernels.cpu_extension import load_cpu_extension
from kvrelay_kernels.cpu_fused import load_fused_ops

# It computes nothing itself (the kernels it calls were built with their own flags).
_FLAGS = ["-O3", "-march=native"]


def load_stack_ops() -> ModuleType | None:
    """The compiled module (`DecoderStack`), built on the first call; None where it cannot be
    built."""
    return load_cpu_extension(
        "kvrelay_cpu_decoder_stack", "decoder_stack.cpp", _FLAGS, "CPU decoder stack"
    )


def new_decoder_stack(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    matmul_modules: Sequence[ModuleType],
) -> Any | None:
    """An empty `DecoderStack` bound to the kernels it calls: the fused element-wise ops, decode
    attention and the KV write, and the matmul kernels of `matmul_modules` (the extensions
    the layers' matmuls run in). Layers are added with `add_layer`; None where the stack or
    one of those extensions does not build."""
    stack_ops = load_stack_ops()
    kernel_modules = [load_fused_ops(), cpu_backend.load_extension(), *matmul_modules]
    if stack_ops is None or any(module is None for module in kernel_modules):
        return None
    entries: dict[str, Any] = {}
    for module in kernel_modules:
        entries.update(module.entries)  # type: ignore[union-attr]
    return stack_ops.DecoderStack(entries, num_heads, num_kv_heads, head_dim, eps, scale)
