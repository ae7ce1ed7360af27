"""Triton varlen paged attention: prefill chunks and decode tokens of one step in one launch.

Importing this module imports triton; `triton_backend` imports it lazily so that nothing else
pays for (or is configured by) triton. It runs on CUDA tensors, and on CPU tensors under
TRITON_INTERPRET=1 (the CI check). Semantics: `reference.paged_attention`, sliding window and
soft cap included (each a constexpr switch, so plain attention compiles to the code it was).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay_kernels.attention_variants import check_variants
from kvrelay_kernels.plan import AttentionPlan

_LOG2E = 1.4426950408889634
_LOG2E_C: tl.constexpr = tl.constexpr(_LOG2E)  # the same, as kernels read a global


@triton.jit
def _find_sequence(cu_tiles_ptr, num_seqs, tile):  # type: ignore[no-untyped-def]
    """The sequence owning query tile `tile`: the last s with cu_tiles[s] <= tile (binary
    search; cu_tiles has num_seqs + 1 entries). Returns num_seqs for tiles past the end."""
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        right = tl.load(cu_tiles_ptr + mid + 1) <= tile
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _locate_tile(  # type: ignore[no-untyped-def]  # triton params
    cu_tiles_ptr, qsl_ptr, seq_lens_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr
):
    """Where query tile `tile` lies: its sequence, the sequence's first query row, its query
    length (0 for a tile past the last one), its context length, and the tile's first token
    within the query."""
    seq = _find_sequence(cu_tiles_ptr, num_seqs, tile)
    live = seq < num_seqs  # the grid is an upper bound on the number of tiles
    seq = tl.minimum(seq, num_seqs - 1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.where(live, tl.load(qsl_ptr + seq + 1) - q_start, 0)
    context = tl.load(seq_lens_ptr + seq)
    tok0 = (tile - tl.load(cu_tiles_ptr + seq)) * BLOCK_Q
    return seq, q_start, q_len, context, tok0


@triton.jit
def _soft_cap(s, cap):  # type: ignore[no-untyped-def]  # triton params
    """cap * tanh(s / cap), tanh written with exp2 (tl.math has no tanh in every release): it
    saturates to +-1 through inf and 0, no NaN."""
    e = tl.math.exp2(s * (2.0 * _LOG2E_C) / cap)
    return cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _scores_seen(  # type: ignore[no-untyped-def]  # triton params
    s, pos, pos_ok, q_pos, window, cap, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr
):
    """A tile's scores `s` [ROWS, BLOCK_N] (base 2), capped when HAS_CAP, with a finite minimum
    where a row does not see the key: a later one, one past the context, or (HAS_WINDOW) one
    before the row's window. With a window a row may see no key in its first iterations: its
    sums gather garbage at a max of -1e30 until its first real key, whose rescale
    exp2(-1e30 - max) = 0 wipes them (every row sees its own position)."""
    if HAS_CAP:
        s = _soft_cap(s, cap)
    visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
    if HAS_WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    return tl.where(visible, s, -1.0e30)


@triton.jit
def _key_range(  # type: ignore[no-untyped-def]  # triton params
    context, q_len, tok0, window, BLOCK_Q: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """The keys [lo, end) a query tile reads. Causal: its last query sees keys up to its own
    position, and a dead tile reads nothing; with a window, its first query sees the earliest
    key, and keys before that are skipped. (An if block, not a ternary: triton compiles only
    the constexpr-chosen side of an if.)"""
    end = tl.where(tok0 < q_len, context - q_len + tl.minimum(tok0 + BLOCK_Q, q_len), 0)
    if HAS_WINDOW:  # noqa: SIM108
        lo = tl.maximum(context - q_len + tok0 - window + 1, 0)
    else:
        lo = 0
    return lo, end


@triton.jit
def _attend_context(  # type: ignore[no-untyped-def]  # triton params
    q,  # [ROWS, HEAD_DIM_P]
    q_pos,  # [ROWS]: each row's own position; it sees keys 0..q_pos
    base,  # this layer's and KV head's K at block 0, token 0
    table,  # this sequence's block table
    kv_lo,  # keys before this position are never read (the tile's first window edge)
    kv_end,  # keys past this position are never read
    window,  # HAS_WINDOW: a row sees keys q_pos - window < j <= q_pos
    cap,  # HAS_CAP: scores (log2 domain) become cap * tanh(s / cap)
    dims,
    dim_ok,
    stride_block,
    stride_kv,
    stride_token,
    qk_scale,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    DOT_F32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    """Causal online-softmax attention of the tile's rows over keys [kv_lo, kv_end), BLOCK_N
    keys at a time; returns the normalized output, [ROWS, HEAD_DIM_P] fp32."""
    # Masked scores are a finite minimum, not -inf: every live row sees key 0 in the first
    # iteration, so its running max is real from then on; dead rows compute harmless garbage
    # that is never stored (with -inf they would compute NaN = -inf - -inf). (Windows:
    # _scores_seen.)
    m_i = tl.full((ROWS,), -1.0e30, tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM_P), tl.float32)
    for start in range(kv_lo, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        offs = block * stride_block + (pos % BLOCK_SIZE) * stride_token  # [BLOCK_N]
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(base + stride_kv + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        s = _scores_seen(s * qk_scale, pos, pos_ok, q_pos, window, cap, HAS_WINDOW, HAS_CAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:  # a constexpr branch: triton compiles only one side
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


# Ints that change from step to step or layer to layer are not specialized on (Triton would
# otherwise compile a variant for a value of 1 and for multiples of 16): a new variant is a
# compile, and a compile met while serving stalls a step (jit_watch.py).
# One program: BLOCK_Q query tokens of one sequence x the GROUP query heads of one KV head, so
# the K/V tiles it loads serve the whole GQA group. Rows are (token, head) pairs.
@triton.jit(do_not_specialize=["num_seqs", "layer_offset", "stride_table", "window"])
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # triton params
    out_ptr,
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    cu_tiles_ptr,
    num_seqs,
    layer_offset,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_block,
    stride_kv,
    stride_token,
    stride_head,
    stride_table,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    window,  # HAS_WINDOW: keys each query sees, itself included
    cap,  # HAS_CAP: the soft cap * log2(e) (the scores' base-2 domain)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP_P rows
    BLOCK_N: tl.constexpr,  # context tokens per iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens)
    DOT_F32: tl.constexpr,  # exact fp32 dots (not tf32 nor bf16): fp32 caches, the interpreter
    HAS_WINDOW: tl.constexpr,  # a sliding window (`window`); else every earlier key
    HAS_CAP: tl.constexpr,  # soft-capped scores (`cap`)
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq, q_start, q_len, context, tok0 = _locate_tile(
        cu_tiles_ptr, qsl_ptr, seq_lens_ptr, num_seqs, tile, BLOCK_Q
    )
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    tok = tok0 + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=mask)

    kv_lo, kv_end = _key_range(context, q_len, tok0, window, BLOCK_Q, HAS_WINDOW)
    q_pos = context - q_len + tok  # the query's own position: it sees keys 0..q_pos
    base = cache_ptr + layer_offset + kv_head * stride_head
    table = tables_ptr + seq.to(tl.int64) * stride_table
    out = _attend_context(
        q, q_pos, base, table, kv_lo, kv_end, window, cap, dims, dim_ok, stride_block,
        stride_kv, stride_token, qk_scale, BLOCK_Q * GROUP_P, BLOCK_N, BLOCK_SIZE, HEAD_DIM_P,
        DOT_F32, HAS_WINDOW, HAS_CAP,
    )  # fmt: skip
    o_rows = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


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
    """Same meaning as `reference.paged_attention`, one kernel launch for the whole batch."""
    check_variants(sliding_window, soft_cap)
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=kv_cache.dtype, device=query.device)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if kv_cache.stride(5) != 1:
        raise ValueError("kv_cache's head_dim must be contiguous")
    # Without a plan nothing says whether the batch is decode only; size tiles for prefill.
    all_decode = plan is not None and not plan.prefills
    constants = kernel_constants(
        query.shape[1], kv_cache.shape[4], query.shape[2], kv_cache.shape[3],
        kv_cache.dtype, all_decode, compiled=query.is_cuda,
        sliding_window=sliding_window is not None, soft_cap=soft_cap is not None,
    )  # fmt: skip
    block_q, num_seqs = int(constants["BLOCK_Q"]), seq_lens.shape[0]
    cu_tiles = _cumulative_tiles(query_start_loc, block_q)
    # sum(ceil(q_len / block_q)) <= num_tokens // block_q + num_seqs: a host-side bound, so
    # the launch needs no device -> host copy.
    tiles = query.shape[0] // block_q + num_seqs
    variant = (sliding_window or 0, soft_cap or 0.0)  # window, cap (0: unused)
    _launch(query, kv_cache, layer, block_tables, seq_lens, query_start_loc, cu_tiles, tiles,
            scale, out, constants, *variant)  # fmt: skip
    return out


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention by the same kernel, tiled for decodes: `query` `[num_seqs, heads,
    head_dim]`, one token per sequence (the CUDA decode kernel's arguments, so a step's decode
    rows go to either; decode_dispatch.py chooses). One query tile per sequence, so the query
    offsets and the tiles are both 0, 1, 2, ...: a cached device range (no launch to build
    them, nothing read on the host)."""
    check_variants(sliding_window, soft_cap)
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=kv_cache.dtype, device=query.device)
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return out
    if kv_cache.stride(5) != 1:
        raise ValueError("kv_cache's head_dim must be contiguous")
    constants = kernel_constants(
        query.shape[1], kv_cache.shape[4], query.shape[2], kv_cache.shape[3],
        kv_cache.dtype, True, compiled=query.is_cuda,
        sliding_window=sliding_window is not None, soft_cap=soft_cap is not None,
    )  # fmt: skip
    offsets = decode_offsets(num_seqs, query.device)
    variant = (sliding_window or 0, soft_cap or 0.0)
    _launch(query, kv_cache, layer, block_tables, seq_lens, offsets, offsets, num_seqs, scale,
            out, constants, *variant)  # fmt: skip
    return out


# Per device, every range made so far: a captured CUDA graph keeps reading the one it was
# captured with, so none is ever freed (a few KiB at most).
_OFFSETS: dict[torch.device, list[torch.Tensor]] = {}


def decode_offsets(num_seqs: int, device: torch.device) -> torch.Tensor:
    """`[num_seqs + 1]` int32 0, 1, 2, ... on `device`: a view of a cached range, grown by
    powers of two (made once per size, before graphs are captured: warm-up runs first)."""
    ranges = _OFFSETS.setdefault(device, [])
    if not ranges or ranges[-1].shape[0] < num_seqs + 1:
        size = _pow2_at_least(num_seqs + 1, 64)
        ranges.append(torch.arange(size, dtype=torch.int32, device=device))
    return ranges[-1][: num_seqs + 1]


def _launch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_tiles: torch.Tensor,
    num_tiles: int,
    scale: float,
    out: torch.Tensor,
    constants: dict[str, int | bool],
    window: int,
    cap: float,
) -> None:
    """One launch of the kernel: `num_tiles` query tiles (at least the sequences' own: tiles
    past them do nothing) x the KV heads; `window` and `cap` 0 where unused."""
    _paged_attention_kernel[(num_tiles, kv_cache.shape[4])](
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        cu_tiles,
        seq_lens.shape[0],
        layer * kv_cache.stride(1),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        block_tables.stride(0),
        scale * _LOG2E,
        window,
        cap * _LOG2E,
        **constants,
        num_warps=NUM_WARPS,
    )


NUM_WARPS = 4


def kernel_constants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    all_decode: bool,
    *,
    compiled: bool,
    sliding_window: bool = False,
    soft_cap: bool = False,
) -> dict[str, int | bool]:
    """The kernel's constexpr arguments (its tile shape) for a batch of this shape;
    `compiled`: for a GPU (False: the CPU interpreter); `sliding_window`, `soft_cap`: whether
    the call has them (a variant of its own, compiled on first use)."""
    group = num_heads // num_kv_heads
    group_p = _pow2_at_least(group)
    head_dim_p = _pow2_at_least(head_dim, 16)
    return {
        "GROUP": group,
        "GROUP_P": group_p,
        # tl.dot needs at least 16 rows; decode tiles hold one token, prefill tiles ~64 rows.
        "BLOCK_Q": max(1, (16 if all_decode else 64) // group_p),
        "BLOCK_N": 64 if head_dim_p <= 128 else 32,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P": head_dim_p,
        "BLOCK_SIZE": block_size,
        # triton 3.9's interpreter computes bf16 / fp16 tl.dot wrongly (garbage): it does
        # those dots in fp32, on the same 16-bit inputs.
        "DOT_F32": dtype == torch.float32 or not compiled,
        "HAS_WINDOW": sliding_window,
        "HAS_CAP": soft_cap,
    }


def _cumulative_tiles(query_start_loc: torch.Tensor, block_q: int) -> torch.Tensor:
    """`[num_seqs + 1]` int32: the first query tile of each sequence, then the total."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles = torch.div(q_lens + block_q - 1, block_q, rounding_mode="floor")
    cu_tiles = torch.zeros(q_lens.shape[0] + 1, dtype=torch.int32, device=query_start_loc.device)
    cu_tiles[1:] = torch.cumsum(tiles, 0)
    return cu_tiles
