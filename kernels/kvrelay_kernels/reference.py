"""Torch reference of the kvrelay kernel ops: it defines what each op means, and is the CPU path.

The KV cache is block-major, `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`
(docs/architecture.md section 3); a slot is `block_id * block_size + offset`. This module must stay
free of any engine or model import: it is the bottom layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay_kernels.attention_variants import check_variants
from kvrelay_kernels.plan import AttentionPlan, build_plan, split_slots


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    plan: AttentionPlan | None = None,
) -> None:
    """Scatter new keys and values into their slots of one layer.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`.
        kv_cache: the block-major cache, written in place.
        layer: the decoder layer.
        slot_mapping: `[num_tokens]` int64 slot of each token; negative slots are skipped
            (padding tokens that own no slot).
        plan: the step's plan; when it carries the slots' block / offset split (built with
            the same `slot_mapping`), it is reused instead of recomputed per layer, and its
            `slot_keep` drops padding tokens without reading a slot on the host (on a device,
            the plan-less path syncs to find them).
    """
    if plan is not None and plan.slot_blocks is not None and plan.slot_offsets is not None:
        blocks, offsets = plan.slot_blocks, plan.slot_offsets
        if plan.slot_keep is not None:
            key, value = key.index_select(0, plan.slot_keep), value.index_select(0, plan.slot_keep)
    else:
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        blocks, offsets = split_slots(slot_mapping, kv_cache.shape[3])
    kv_cache[blocks, layer, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, offsets] = value.to(kv_cache.dtype)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (every layer, K and V) from `src[i]` to `dst[i]` (copy-on-write)."""
    if src.numel():
        kv_cache[dst] = kv_cache[src]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch of query chunks over their paged context.

    Sequence `i` owns query tokens `query_start_loc[i]:query_start_loc[i+1]`; they are the
    last `q_len` tokens of its `seq_lens[i]` context tokens, whose keys and values (the new
    ones included) are already in the cache at the blocks `block_tables[i]`. Query heads
    share KV heads in groups of `num_heads // num_kv_heads` (GQA).

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        kv_cache: the block-major cache (read only).
        layer: the decoder layer to read.
        block_tables: `[num_seqs, max_blocks_per_seq]` int block ids (padding ignored).
        seq_lens: `[num_seqs]` context length of each sequence, new tokens included.
        query_start_loc: `[num_seqs + 1]` cumulative query offsets.
        scale: softmax scale, usually `head_dim ** -0.5`.
        plan: the same metadata pre-digested once per step (`build_plan`); optional.
        out: `[num_tokens, num_heads, head_dim]` buffer to write into; optional.
        sliding_window, soft_cap: the layer's window and score cap (attention_variants.py);
            None: every earlier key, no cap.

    Returns:
        `[num_tokens, num_heads, head_dim]` attention output.

    Raises:
        ValueError: `sliding_window` or `soft_cap` is out of its domain.
    """
    check_variants(sliding_window, soft_cap)
    if plan is None:
        plan = build_plan(block_tables, seq_lens, query_start_loc, kv_cache.shape[3])
    variant = (sliding_window, soft_cap)
    # [num_blocks, block_size * kv_heads * head_dim]: one row per block, rows strided by the
    # other layers. torch's index_select copies such 2-D rows with memcpy; on the 4-D view of
    # the same data it fell to a per-element path about 10x slower (measured on CPU).
    keys, values = _layer_rows(kv_cache, layer)
    shape = (kv_cache.shape[3], kv_cache.shape[4])  # (block_size, kv_heads)
    if plan.has_decodes and plan.decode_token_idx is None and out is None:  # all decodes
        return _decode_attention(query, keys, values, plan, scale, shape, *variant)
    if plan.has_decodes:
        rows = plan.decode_token_idx  # None: every row is a decode, in order
        decode_q = query if rows is None else query[rows]
        decoded = _decode_attention(decode_q, keys, values, plan, scale, shape, *variant)
        out = place_decode_rows(query, rows, decoded, out)
    elif out is None:
        out = torch.empty_like(query)
    prefill_attention(query, kv_cache, layer, plan, scale, out, *variant)
    return out


def place_decode_rows(
    query: torch.Tensor, rows: torch.Tensor | None, decoded: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """Write the decode rows' attention `decoded` into `out` at `rows` (None: every row, in
    order) and return `out`; a None `out` is first allocated like `query`."""
    if out is None:
        out = torch.empty_like(query)
    if rows is None:
        out.copy_(decoded)
    else:
        out[rows] = decoded
    return out


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Write into `out` the causal attention of the plan's multi-token chunks (prefill), with
    `paged_attention`'s window and cap."""
    keys, values = _layer_rows(kv_cache, layer)
    shape = (-1, *kv_cache.shape[4:])  # [blocks * block_size, kv_heads, head_dim]
    for chunk in plan.prefills:
        q = query[chunk.q_start : chunk.q_end]
        k = keys.index_select(0, chunk.block_ids).view(shape)[: chunk.context_len]
        v = values.index_select(0, chunk.block_ids).view(shape)[: chunk.context_len]
        out[chunk.q_start : chunk.q_end] = _chunk_attention(
            q, k, v, chunk.context_len, scale, sliding_window, soft_cap
        )


def _layer_rows(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of one layer as `[num_blocks, block_size * kv_heads * head_dim]` views."""
    num_blocks, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    if not kv_cache.is_contiguous():
        kv_cache = kv_cache.contiguous()  # only a caller-built strided cache pays this
    rows = kv_cache.view(num_blocks, num_layers, 2, block_size * kv_heads * head_dim)
    return rows[:, layer, 0], rows[:, layer, 1]


def _decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    shape: tuple[int, int],
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """One query token per sequence, all sequences batched in one gather and one SDPA call.

    `keys`, `values`: one layer's `[num_blocks, block_size * kv_heads * head_dim]` rows;
    `shape`: the cache's (block_size, kv_heads).
    """
    assert plan.decode_block_tables is not None
    block_size, num_kv_heads = shape
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    tables = plan.decode_block_tables
    padded = tables.shape[1] * block_size
    context = plan.decode_context
    # k, v: [seqs, blocks * block_size, kv_heads, head_dim] -> [seqs, kv_heads, ctx, head_dim]
    k = keys.index_select(0, tables.flatten()).view(num_seqs, padded, num_kv_heads, head_dim)
    v = values.index_select(0, tables.flatten()).view(num_seqs, padded, num_kv_heads, head_dim)
    k, v = k[:, :context].transpose(1, 2), v[:, :context].transpose(1, 2)
    # The query heads of one KV head become that head's `group` query rows: GQA without
    # repeating K/V. q: [seqs, kv_heads, group, head_dim]
    q = q.view(num_seqs, num_kv_heads, group, head_dim).to(k.dtype)
    mask = plan.decode_mask if sliding_window is None else _decode_window_mask(plan, sliding_window)
    if soft_cap is not None:
        o = _capped_attention(q, k, v, mask, scale, soft_cap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def _decode_window_mask(plan: AttentionPlan, sliding_window: int) -> torch.Tensor:
    """`[decodes, 1, 1, context]` bool: the keys each decode sees, its last `sliding_window`
    (a decode's own position is its length - 1)."""
    lens = plan.decode_lens
    assert lens is not None, "a plan with decodes has their lengths"
    positions = torch.arange(plan.decode_context, device=lens.device).unsqueeze(0)
    lens = lens.unsqueeze(1)
    visible = (positions < lens) & (positions >= lens - sliding_window)
    return visible.view(lens.shape[0], 1, 1, plan.decode_context)


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    """Masked attention with soft-capped scores, in fp32 (SDPA has no cap): q `[..., Q, D]`,
    k, v `[..., K, D]` (same heads), mask broadcast to `[..., Q, K]`; out in q's dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v.float()).to(q.dtype)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's query chunk (its last `q_len` positions)."""
    q_len, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    # [1, heads, tokens, head_dim]: with a batch dimension the CPU picks its flash kernel; 3-D
    # inputs take SDPA's math path, 6-11x slower for a 128-512 token bf16 prefill here.
    qh = q.transpose(0, 1).unsqueeze(0).to(k.dtype)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if sliding_window is None and soft_cap is None and q_len == context_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)
    mask = _chunk_mask(q_len, context_len, sliding_window, q.device)
    if soft_cap is not None:
        group = num_heads // num_kv_heads
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        o = _capped_attention(qh, kh, vh, mask, scale, soft_cap)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _chunk_mask(
    q_len: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """`[q_len, context_len]` bool: the keys each of the chunk's queries (the context's last
    `q_len` positions) sees: causal, and within the window when there is one."""
    # Built on the inputs' device: a CPU mask would not mix with CUDA queries.
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (context_len - q_len)
    keys = torch.arange(context_len, device=device).unsqueeze(0)
    mask = keys <= rows
    if sliding_window is not None:
        mask &= keys > rows - sliding_window
    return mask
