"""Triton RoPE of q and k fused with the KV-cache write, straight from the fused qkv projection:
one launch, one program per token.

Each program rotates the token's q heads into a new contiguous `[T, h, d]` tensor, rotates its
k heads, and stores them with its v heads (unrotated) in the cache slot `slot_mapping[t]` of
one layer (a negative slot is a padding token: its q is still rotated, nothing is cached).

Numerics are bit for bit those of `apply_rope_with_torch_ops` (services/kvrelay/models/rope.py)
on q and k followed by `reference.write_kv`: each product is rounded to qkv's dtype, then the
difference / sum, then the conversion to the cache dtype. The launch disables FMA contraction:
in fp32 `x1 * cos - x2 * sin` would otherwise become one fused multiply-add on the GPU, which
rounds once where torch rounds twice. Imported lazily, like `triton_write_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay_kernels.triton_fused_common import alignment, round_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A token's q tile is at most a few thousand elements ([32 heads, 64] per half for Llama-8B).
NUM_WARPS = 4
# No FMA contraction (see the module docstring); the kernel has no sum that would gain from it.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rotate(x1, x2, cos, sin):  # type: ignore[no-untyped-def]  # triton params
    """`(x1 * cos - x2 * sin, x2 * cos + x1 * sin)` with torch's roundings: every product and
    the final sum rounded to x's dtype (products of two 16-bit values are exact in fp32)."""
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a = round_to(x1f * cos, dtype).to(tl.float32)
    b = round_to(x2f * sin, dtype).to(tl.float32)
    c = round_to(x2f * cos, dtype).to(tl.float32)
    d = round_to(x1f * sin, dtype).to(tl.float32)
    return round_to(a - b, dtype), round_to(c + d, dtype)


@triton.jit
def _rope_q(  # type: ignore[no-untyped-def]  # triton params
    row,
    q_dst_row,
    cos,
    sin,
    j,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
):
    """One token's q heads: [heads, half] tiles of both halves, rotated into its q row."""
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, HEADS_P)[:, None]
    q_mask = (heads < NUM_HEADS) & (j < HALF)
    q_src = row + heads * HEAD_DIM + j
    q1, q2 = _rotate(tl.load(q_src, mask=q_mask), tl.load(q_src + HALF, mask=q_mask), cos, sin)
    q_dst = q_dst_row + heads * HEAD_DIM + j
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + HALF, q2, mask=q_mask)


@triton.jit
def _rope_k_and_write_kv(  # type: ignore[no-untyped-def]  # triton params
    row,
    slot_base,
    slot,
    cos,
    sin,
    j,
    stride_kv,
    stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """One token's k (rotated) and v into its cache slot. A negative slot is a padding
    token: nothing is read from or written to the cache for it. (The slot test is broadcast
    to the tile explicitly: the interpreter rejects a scalar mask.)"""
    HALF: tl.constexpr = HEAD_DIM // 2
    kv_heads = tl.arange(0, KV_HEADS_P)[:, None]
    slots = tl.zeros((KV_HEADS_P, HALF_P), tl.int64) + slot
    k_mask = (kv_heads < NUM_KV_HEADS) & (j < HALF) & (slots >= 0)
    k_src = row + (NUM_HEADS + kv_heads) * HEAD_DIM + j
    k1, k2 = _rotate(tl.load(k_src, mask=k_mask), tl.load(k_src + HALF, mask=k_mask), cos, sin)
    k_dst = slot_base + kv_heads * stride_head + j
    tl.store(k_dst, round_to(k1, slot_base.dtype.element_ty), mask=k_mask)
    tl.store(k_dst + HALF, round_to(k2, slot_base.dtype.element_ty), mask=k_mask)

    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    v_slots = tl.zeros((KV_HEADS_P, HEAD_DIM_P), tl.int64) + slot
    v_mask = (kv_heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (v_slots >= 0)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_heads) * HEAD_DIM + dims, mask=v_mask)
    v_dst = slot_base + stride_kv + kv_heads * stride_head + dims
    tl.store(v_dst, round_to(v, slot_base.dtype.element_ty), mask=v_mask)


@triton.jit(do_not_specialize=["stride_qkv", "stride_cos", "stride_sin", "layer"])
def _rope_kv_kernel(  # type: ignore[no-untyped-def]  # triton params
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    layer,
    stride_block,
    stride_layer,
    stride_kv,
    stride_token,
    stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    TABLE_ALIGN: tl.constexpr,
):
    # Row strides and the layer vary (batch, layer) and are not specialized (their alignment
    # comes as constexprs: triton_fused_common); the cache's strides are engine constants.
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + tl.multiple_of(t * stride_qkv, ROW_ALIGN)
    j = tl.arange(0, HALF_P)[None, :]
    cos_row = cos_ptr + tl.multiple_of(t * stride_cos, TABLE_ALIGN)
    sin_row = sin_ptr + tl.multiple_of(t * stride_sin, TABLE_ALIGN)
    cos = tl.load(cos_row + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + j, mask=j < HALF, other=0.0).to(tl.float32)
    q_dst_row = q_out_ptr + t * (NUM_HEADS * HEAD_DIM)
    _rope_q(row, q_dst_row, cos, sin, j, NUM_HEADS, HEAD_DIM, HEADS_P)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    slot_base = (
        cache_ptr
        + layer.to(tl.int64) * stride_layer
        + (slot // BLOCK_SIZE) * stride_block
        + (slot % BLOCK_SIZE) * stride_token
    )
    _rope_k_and_write_kv(
        row, slot_base, slot, cos, sin, j, stride_kv, stride_head,
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_HEADS_P, HALF_P, HEAD_DIM_P,
    )  # fmt: skip


def kernel_constants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    row_align: int = 16,
    table_align: int | None = None,
) -> dict[str, int]:
    """The kernel's constexpr arguments for this model and cache (model constants only; the
    alignments default to those of contiguous qkv and cos / sin rows)."""
    if table_align is None:
        table_align = alignment(head_dim // 2)
    return {
        "NUM_HEADS": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "HEADS_P": triton.next_power_of_2(num_heads),
        "KV_HEADS_P": triton.next_power_of_2(num_kv_heads),
        "HALF_P": triton.next_power_of_2(head_dim // 2),
        "HEAD_DIM_P": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
        "ROW_ALIGN": row_align,
        "TABLE_ALIGN": table_align,
    }


def _check(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """What the kernel would crash on or misread, from shapes and strides only (no sync: the
    slot values themselves are not checked)."""
    if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0 or head_dim % 2:
        raise ValueError(
            f"need positive head counts and an even head_dim, got {num_heads} / "
            f"{num_kv_heads} / {head_dim}"
        )
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [tokens, {width}], got shape {tuple(qkv.shape)}")
    if qkv.dtype not in DTYPES or kv_cache.dtype not in DTYPES:
        raise ValueError(f"qkv and kv_cache must be fp32, fp16 or bf16, got {qkv.dtype} / "
                         f"{kv_cache.dtype}")  # fmt: skip
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv's last dim must be contiguous, got strides {qkv.stride()}")
    num_tokens = qkv.shape[0]
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, 1, head_dim // 2):
            raise ValueError(
                f"{name} must be [{num_tokens}, 1, {head_dim // 2}], got {tuple(table.shape)}"
            )
        if table.dtype != qkv.dtype:
            raise ValueError(f"{name} dtype {table.dtype} differs from qkv's {qkv.dtype}")
        if table.stride(2) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, got {table.stride()}")
    cache_shape = (2, num_kv_heads, head_dim)
    if kv_cache.dim() != 6 or (kv_cache.shape[2], *kv_cache.shape[4:]) != cache_shape:
        raise ValueError(
            "kv_cache must be [blocks, layers, 2, block_size, "
            f"{num_kv_heads}, {head_dim}], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(5) != 1:
        raise ValueError(f"kv_cache's last dim must be contiguous, got {kv_cache.stride()}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} is outside the cache's {kv_cache.shape[1]} layers")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    for name, tensor in (("cos", cos), ("sin", sin), ("kv_cache", kv_cache),
                         ("slot_mapping", slot_mapping)):  # fmt: skip
        if tensor.device != qkv.device:
            raise ValueError(f"{name} is on {tensor.device}, qkv on {qkv.device}")


def rope_and_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Rotate q and k of the fused projection, cache k and v, in one launch.

    Same result as `apply_rope_with_torch_ops` on q and on k, then `reference.write_kv(k, v,
    kv_cache, layer, slot_mapping)`, bit for bit.

    Args:
        qkv: `[T, (h + 2 * kvh) * d]`: each token's q heads, then k heads, then v heads; last
            dim contiguous (rows may be strided).
        cos, sin: `[T, 1, d // 2]` in qkv's dtype (`RotaryEmbedding.cos_sin`).
        kv_cache: `[num_blocks, num_layers, 2, block_size, kvh, d]`, any strides with a
            contiguous last dim (a view is fine), any of the three dtypes; written in place.
        layer: the decoder layer whose slots are written.
        slot_mapping: int64 `[T]`; a negative slot (padding) is skipped. Slots must lie in
            the cache: they are not read on the host.
        num_heads, num_kv_heads, head_dim: h, kvh, d.

    Returns:
        The rotated q, a new contiguous `[T, h, d]` in qkv's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides the kernel cannot take.
    """
    _check(qkv, cos, sin, kv_cache, layer, slot_mapping, num_heads, num_kv_heads, head_dim)
    num_tokens = qkv.shape[0]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    row_align, table_align = alignment(qkv.stride(0)), alignment(cos.stride(0), sin.stride(0))
    constants = kernel_constants(
        num_heads, num_kv_heads, head_dim, kv_cache.shape[3], row_align, table_align
    )
    _rope_kv_kernel[(num_tokens,)](
        qkv, cos, sin, q, kv_cache, slot_mapping, qkv.stride(0), cos.stride(0), sin.stride(0),
        layer, *kv_cache.stride()[:5], **constants, num_warps=NUM_WARPS, **LAUNCH_OPTIONS,
    )  # fmt: skip
    return q
