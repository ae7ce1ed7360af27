"""Triton `write_kv`: scatter new keys and values into their cache slots (one program per
token). Semantics: `reference.write_kv`; imported lazily, like `triton_attention`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay_kernels.plan import AttentionPlan


# The layer's offset changes per layer: not specialized on (see triton_attention.py).
@triton.jit(do_not_specialize=["layer_offset"])
def _write_kv_kernel(  # type: ignore[no-untyped-def]  # triton params
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    layer_offset,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_block,
    stride_kv,
    stride_token,
    stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    # A negative slot is a padding token: nothing is read or written for it.
    # (The slot test is broadcast to the tile explicitly: the interpreter rejects a scalar mask.)
    slots = tl.zeros((HEADS_P, HEAD_DIM_P), tl.int64) + slot
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slots >= 0)
    block = slot // BLOCK_SIZE
    dst = cache_ptr + layer_offset + block * stride_block + (slot % BLOCK_SIZE) * stride_token
    dst = dst + heads * stride_head + dims
    t = token.to(tl.int64)
    key = tl.load(key_ptr + t * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    value = tl.load(value_ptr + t * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    plan: AttentionPlan | None = None,
) -> None:
    """Same meaning as `reference.write_kv` (the plan's slot split is not needed here)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        layer * kv_cache.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        **kernel_constants(num_kv_heads, head_dim, kv_cache.shape[3]),
        num_warps=NUM_WARPS,
    )


NUM_WARPS = 1  # one token per program: a [heads, head_dim] tile is a few hundred elements


def kernel_constants(num_kv_heads: int, head_dim: int, block_size: int) -> dict[str, int]:
    """The kernel's constexpr arguments for this cache shape."""
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "HEADS_P": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
    }
