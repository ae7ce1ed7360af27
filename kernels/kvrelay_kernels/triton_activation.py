"""Triton `silu(gate) * up` of the fused gate/up projection, `[T, 2*I] -> [T, I]`, in one launch:
one program per (token, block of `BLOCK` columns).

Numerics are those of `GatedMLP.silu_and_mul_with_torch_ops` (services/kvrelay/models/
layers.py): silu in fp32 as `g / (1 + exp(-g))` (IEEE division), rounded to the dtype, then
the product with `up` rounded again. On the GPU exp is libdevice's `expf`, the function torch's
CUDA silu calls; the interpreter has no libdevice and uses `tl.exp` (numpy's). Either way exp
may differ from torch's CPU exp in the last bit of fp32. Imported lazily, like `triton_write_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvrelay_kernels.triton_fused_common import alignment, round_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Columns per program: 8 per thread at 4 warps, i.e. one 16-byte vector per thread in bf16/fp16.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["stride_in"])
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]  # triton params
    gate_up_ptr,
    out_ptr,
    stride_in,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    # The row stride is not specialized (a new batch must not recompile); its alignment comes
    # as a constexpr instead, so loads still vectorize (triton_fused_common).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    src = gate_up_ptr + tl.multiple_of(row * stride_in, ROW_ALIGN)
    gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # On the GPU `tl.exp` is ex2.approx of a rounded product, off by several ulp for large
    # |gate|; libdevice's expf is what torch's CUDA silu computes with. (A constexpr test: the
    # interpreter, which lacks libdevice, never meets that branch.)
    e = libdevice.exp(-gate) if LIBDEVICE_EXP else tl.exp(-gate)
    # `/` is approximate on the GPU; torch's silu divides in IEEE (CPU and CUDA).
    silu = round_to(tl.math.div_rn(gate, 1.0 + e), out_ptr.dtype.element_ty)  # F.silu's rounding
    out = round_to(silu.to(tl.float32) * up, out_ptr.dtype.element_ty)  # `mul_`'s rounding
    tl.store(out_ptr + row * INTER + cols, out, mask=mask)


def kernel_constants(intermediate: int, libdevice_exp: bool, row_align: int = 16) -> dict[str, int]:
    """The kernel's constexpr arguments for this intermediate size (model constants only; the
    alignment defaults to that of 16-element-aligned rows)."""
    return {
        "INTER": intermediate,
        "BLOCK": BLOCK,
        "ROW_ALIGN": row_align,
        "LIBDEVICE_EXP": int(libdevice_exp),
    }


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = gate_up.split(I, dim=-1)`, in one launch.

    Args:
        gate_up: `[T, 2 * I]`, fp32 / fp16 / bf16, last dim contiguous (rows may be strided).

    Returns:
        A new contiguous `[T, I]` in gate_up's dtype.

    Raises:
        ValueError: a shape, dtype or stride the kernel cannot take.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * I], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up must be fp32, fp16 or bf16, got {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"gate_up's last dim must be contiguous, got strides {gate_up.stride()}")
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    row_align = alignment(gate_up.stride(0))
    grid = (num_tokens, triton.cdiv(intermediate, BLOCK))
    _silu_and_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        **kernel_constants(intermediate, gate_up.is_cuda, row_align),
        num_warps=NUM_WARPS,
    )
    return out
