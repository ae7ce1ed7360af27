"""Per-step attention metadata, digested once and shared by every layer.

Splitting the batch into decode tokens (one query each, batched together) and prefill chunks
(one causal attention each) is what keeps the torch path free of per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with more than one query token this step."""

    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass(frozen=True)
class AttentionPlan:
    """The batch of one step, split by kind.

    `decode_*` are None when the step has no single-token sequence.
    """

    decode_token_idx: torch.Tensor | None  # [num_decodes] int64 query row of each decode
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillChunk, ...]


def build_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> AttentionPlan:
    """Digest the step's metadata (see `paged_attention` for the meaning of each argument)."""
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    prefills: list[PrefillChunk] = []
    for i, context_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_blocks = -(-context_len // block_size)
        if q_end - q_start == 1:
            decode_rows.append(q_start)
            decode_seqs.append(i)
        elif q_end > q_start:
            ids = block_tables[i, :num_blocks].to(torch.int64)
            prefills.append(PrefillChunk(q_start, q_end, context_len, ids))
    if not decode_seqs:
        return AttentionPlan(None, None, None, tuple(prefills))
    seq_idx = torch.tensor(decode_seqs, dtype=torch.int64)
    dec_lens = seq_lens.to(torch.int64)[seq_idx]
    max_blocks = -(-int(dec_lens.max()) // block_size)
    tables = block_tables[seq_idx, :max_blocks].to(torch.int64)
    positions = torch.arange(max_blocks * block_size)
    mask = (positions.unsqueeze(0) < dec_lens.unsqueeze(1)).view(len(decode_seqs), 1, 1, -1)
    rows = torch.tensor(decode_rows, dtype=torch.int64)
    return AttentionPlan(rows, tables, mask, tuple(prefills))
