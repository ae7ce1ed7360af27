"""Triton RMSNorm, and the residual add fused with it: one launch each, one program per token
row, the whole row in registers (a power-of-two block over `hidden`, masked).

Numerics are those of `RMSNorm.forward_with_torch_ops` / `RMSNorm.add_and_norm`
(services/kvrelay/models/layers.py): the inverse RMS in fp32, `x * inv` rounded to x's dtype,
times the weight, rounded again (for fp32 the first rounding is a no-op: F.rms_norm's two
fp32 products). Only the sum of squares is ordered differently from torch's, so the fp32
inverse RMS may differ from torch's in its last bits. Imported lazily, like `triton_write_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay_kernels.triton_fused_common import alignment, round_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The row is held in registers: at 32768 a 16-warp program keeps 64 fp32 values per thread
# (plus the weight); beyond that it would spill, and no Llama-family model is that wide.
MAX_HIDDEN = 32768


@triton.jit(do_not_specialize=["stride_x", "stride_delta"])
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # triton params
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_delta,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    # The row strides are not specialized (a new batch must not recompile); their alignment
    # comes as a constexpr instead, so loads still vectorize (triton_fused_common).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x_row = x_ptr + tl.multiple_of(row * stride_x, ROW_ALIGN)
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        # `residual.add_(delta)`: the sum in fp32, rounded to the residual's dtype, stored in
        # place; the norm then reads the rounded sum, as the torch code reads the residual.
        d_row = delta_ptr + tl.multiple_of(row * stride_delta, ROW_ALIGN)
        delta = tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
        summed = round_to(x + delta, x_ptr.dtype.element_ty)
        tl.store(x_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    # Masked lanes are 0 and add nothing; the mean divides by the true width. IEEE division
    # (plain `/` is approximate on the GPU) like torch's mean; rsqrt as torch's CUDA kernel.
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=0), HIDDEN)
    inv_rms = tl.math.rsqrt(mean_square + eps)
    normed = round_to(x * inv_rms, out_ptr.dtype.element_ty)  # HF's cast back before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(normed.to(tl.float32) * weight, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * HIDDEN + cols, out, mask=mask)


def num_warps(hidden: int) -> int:
    """Warps per row: 2 up to hidden 1024, then one more warp per 512 columns, at most 16
    (about 16 fp32 values of the row per thread at hidden 8192)."""
    return min(16, max(2, triton.next_power_of_2(hidden) // 512))


def kernel_constants(hidden: int, add: bool, row_align: int = 16) -> dict[str, int]:
    """The kernel's constexpr arguments for this width (model constants only; the alignment
    defaults to that of 16-element-aligned rows)."""
    return {
        "HIDDEN": hidden,
        "BLOCK": triton.next_power_of_2(hidden),
        "ADD": int(add),
        "ROW_ALIGN": row_align,
    }


def _check(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """What the kernel would crash on or misread, from shapes and strides only (no sync)."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} must be fp32, fp16 or bf16, got {x.dtype}")
    hidden = x.shape[1]
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is outside 1..{MAX_HIDDEN}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {x.stride()}")
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be a contiguous [{hidden}], got shape {tuple(weight.shape)} "
            f"strides {weight.stride()}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from {name}'s {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, {name} on {x.device}")


def _launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    delta_t = x if delta is None else delta  # ADD=0 never reads it
    row_align = alignment(x.stride(0), delta_t.stride(0))
    _rms_norm_kernel[(num_tokens,)](
        x,
        delta_t,
        weight,
        out,
        x.stride(0),
        delta_t.stride(0),
        float(eps),
        **kernel_constants(hidden, delta is not None, row_align),
        num_warps=num_warps(hidden),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward_with_torch_ops` in one launch.

    Args:
        x: `[T, hidden]`, fp32 / fp16 / bf16, last dim contiguous (rows may be strided).
        weight: `[hidden]`, contiguous, in x's dtype.
        eps: added to the mean square.

    Returns:
        A new contiguous `[T, hidden]` in x's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides the kernel cannot take.
    """
    _check("x", x, weight)
    return _launch(x, None, weight, eps)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`residual += delta` in place, then the norm of the new residual: `RMSNorm.add_and_norm`
    in one launch.

    Args:
        residual: `[T, hidden]`, updated in place (the sum rounded to its dtype).
        delta: `[T, hidden]`, same dtype; rows may be strided, last dim contiguous.
        weight, eps: as in `rms_norm`.

    Returns:
        A new contiguous `[T, hidden]`: the norm of the updated residual.

    Raises:
        ValueError: shapes, dtypes, devices or strides the kernel cannot take.
    """
    _check("residual", residual, weight)
    if delta.shape != residual.shape:
        raise ValueError(f"delta shape {tuple(delta.shape)} != residual's {tuple(residual.shape)}")
    if delta.dtype != residual.dtype:
        raise ValueError(f"delta dtype {delta.dtype} differs from residual's {residual.dtype}")
    if delta.device != residual.device:
        raise ValueError(f"delta is on {delta.device}, residual on {residual.device}")
    if delta.stride(1) != 1:
        raise ValueError(f"delta's last dim must be contiguous, got strides {delta.stride()}")
    return _launch(residual, delta, weight, eps)
