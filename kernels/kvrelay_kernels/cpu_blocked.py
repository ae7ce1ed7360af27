"""Dense matmuls on the CPU on weights packed in blocks of 32 outputs
(csrc_cpu/blocked_matmul.cpp): bf16 through AVX512-BF16, fp32 through AVX-512, at every row
count from a decode step's one row to a prefill chunk.

`kvrelay.models.layers.Linear` packs its weight this way where the kernel builds for the
weight's dtype, and keeps oneDNN's packed matmul (or `linear`) elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from kvrelay_kernels.cpu_extension import load_cpu_extension
from kvrelay_kernels.host_memory import ALIGN, huge_page_empty, round_up

# Multiply-adds fused; no fast-math (the sums' order is the kernel's, not the compiler's).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
BLOCK = 32  # outputs per block (the kernel's `kBlock`)


def load_blocked_ops() -> ModuleType | None:
    """The compiled module (`blocked_matmul`, `supports`), built on the first call; None where
    it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_blocked_matmul", "blocked_matmul.cpp", _FLAGS, "CPU blocked matmul"
    )


def blocked_ops_for(weight: torch.Tensor) -> ModuleType | None:
    """The module when its kernel takes `weight` (`[out, in]` on the CPU, a dtype this build
    has a kernel for, an even in-features for bf16); None otherwise."""
    name = _DTYPE_NAMES.get(weight.dtype)
    if name is None or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
        return None
    module = load_blocked_ops()
    if module is None or not module.supports(name):
        return None
    return module


def packed_numel(weight: torch.Tensor) -> int:
    """Elements of `weight`'s packed copy (`pack_blocks`): its outputs padded to blocks."""
    out_features, in_features = weight.shape
    return round_up(out_features, BLOCK) * in_features


def pack_blocks(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` `[out, in]` in the kernel's layout: outputs padded with zeros to blocks of 32;
    per block, fp32 `[in][32]` (each k's 32 outputs side by side), bf16 `[in / 2][32][2]`
    (each pair of k of 32 outputs, as `vdpbf16ps` multiplies pairs).

    Args:
        weight: `[out, in]`, fp32 or bf16.
        out: where to write it (`packed_numel(weight)` elements of `weight`'s dtype,
            contiguous); a new tensor when None.

    Returns:
        The packed weight, 1-D (`out` when given).
    """
    out_features, in_features = weight.shape
    blocks = round_up(out_features, BLOCK) // BLOCK
    padded = weight.detach()
    if out_features % BLOCK:
        padded = F.pad(padded, (0, 0, 0, blocks * BLOCK - out_features))
    if weight.dtype == torch.bfloat16:
        # [blocks, 32, in/2, 2] -> [blocks, in/2, 32, 2]
        grouped = padded.reshape(blocks, BLOCK, in_features // 2, 2).permute(0, 2, 1, 3)
    else:
        grouped = padded.reshape(blocks, BLOCK, in_features).permute(0, 2, 1)
    if out is None:
        return grouped.contiguous().reshape(-1)
    if out.numel() != packed_numel(weight) or out.dtype != weight.dtype:
        raise ValueError(f"out must hold {packed_numel(weight)} {weight.dtype} elements")
    out.view(grouped.shape).copy_(grouped)
    return out


def pack_blocks_together(weights: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Every weight the kernel takes (`blocked_ops_for`) packed (`pack_blocks`) into one
    huge-page allocation, in the order given (a step's order: one run of memory that the
    prefetchers and the TLB serve best, as `models.weight_arena` does for the weights as
    loaded); None for the others. The allocation is the only copy made: each weight is packed
    straight into its place.
    """
    takes = [blocked_ops_for(weight) is not None for weight in weights]
    sizes = [
        round_up(packed_numel(w) * w.element_size(), ALIGN) if take else 0
        for w, take in zip(weights, takes, strict=True)
    ]
    memory = huge_page_empty(max(sum(sizes), ALIGN))
    packed: list[torch.Tensor | None] = []
    offset = 0
    for weight, take, size in zip(weights, takes, sizes, strict=True):
        if not take:
            packed.append(None)
            continue
        nbytes = packed_numel(weight) * weight.element_size()
        place = memory[offset : offset + nbytes].view(weight.dtype)
        packed.append(pack_blocks(weight, out=place))
        offset += size
    return packed
