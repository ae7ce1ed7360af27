"""One step's attention split by kind: decode rows to a decode kernel, prefill rows to a
varlen kernel, both writing into one output.

The plan (plan.py) says where each kind's rows and sequences are. Contiguous kinds (the
common case: the scheduler puts running decodes before new prompts) are passed as views of
the step's tensors, so neither kernel copies anything; otherwise queries and metadata are
gathered by the plan's host-built index tensors (device ops, no sync) and results scattered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrelay_kernels.plan import AttentionPlan

# (query [D, heads, dim] one token per sequence, block_tables [D, W], seq_lens [D], out
# contiguous or None) -> out. Tables and lengths in the step's dtype (int32 in the engine).
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]
# (query, block_tables [P, W], seq_lens [P], query_start_loc [P + 1], out or None) -> out:
# causal varlen attention of P sequences whose query rows are query_start_loc[i] to
# query_start_loc[i + 1] of `query` (and of `out`). The offsets need not start at 0, so a
# slice of the step's offsets makes the kernel read and write only its own rows.
VarlenKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def split_attention(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    plan: AttentionPlan,
    out: torch.Tensor | None,
    decode: DecodeKernel,
    prefill: VarlenKernel,
) -> torch.Tensor:
    """Attention of a step with decodes and prefills (`plan` built from the same metadata):
    `decode` runs once on every decode row, `prefill` once on every prefill row."""
    if out is None:  # contiguous whatever the query's strides: the decode kernel needs it
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.has_decodes:
        _decodes(query, block_tables, seq_lens, plan, out, decode)
    if plan.prefills:
        _prefills(query, block_tables, seq_lens, query_start_loc, plan, out, prefill)
    return out


def _decodes(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: AttentionPlan,
    out: torch.Tensor,
    decode: DecodeKernel,
) -> None:
    if plan.decode_rows is not None and plan.decode_seqs is not None:
        (r0, r1), (s0, s1) = plan.decode_rows, plan.decode_seqs
        target = out[r0:r1]  # rows of a contiguous `out`: contiguous too
        result = decode(query[r0:r1], block_tables[s0:s1], seq_lens[s0:s1], target)
        if result.data_ptr() != target.data_ptr():
            target.copy_(result)
        return
    seq_idx = plan.decode_seq_idx
    assert seq_idx is not None, "a plan with decodes has their spans or their indices"
    rows = plan.decode_token_idx
    q = query if rows is None else query.index_select(0, rows)
    result = decode(
        q, block_tables.index_select(0, seq_idx), seq_lens.index_select(0, seq_idx), None
    )
    if rows is None:
        out.copy_(result)
    else:
        out.index_copy_(0, rows, result)


def _prefills(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    plan: AttentionPlan,
    out: torch.Tensor,
    prefill: VarlenKernel,
) -> None:
    if plan.prefill_seqs is not None:
        p0, p1 = plan.prefill_seqs
        offsets = query_start_loc[p0 : p1 + 1]  # absolute: the kernel writes its own rows
        prefill(query, block_tables[p0:p1], seq_lens[p0:p1], offsets, out)
        return
    rows, seq_idx = plan.prefill_token_idx, plan.prefill_seq_idx
    qsl = plan.prefill_query_start_loc
    assert rows is not None and seq_idx is not None and qsl is not None
    result = prefill(
        query.index_select(0, rows),
        block_tables.index_select(0, seq_idx),
        seq_lens.index_select(0, seq_idx),
        qsl,
        None,
    )
    out.index_copy_(0, rows, result)
