"""Per-step attention metadata, digested once and shared by every layer.

Splitting the batch into decode tokens (one query each, batched together) and prefill chunks
(one causal attention each) is what keeps the torch path free of per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with more than one query token this step."""

    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64

    def to(self, device: torch.device, non_blocking: bool = False) -> PrefillChunk:
        return replace(self, block_ids=self.block_ids.to(device, non_blocking=non_blocking))


@dataclass(frozen=True)
class AttentionPlan:
    """The batch of one step, split by kind.

    `decode_*` are None when the step has no single-token sequence.
    """

    # [num_decodes] int64 query row of each decode; None when every row is a decode, in order
    # (the common all-decode step needs no gather or scatter of queries).
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    # [num_decodes, 1, 1, context] bool; None when all decodes share one context length.
    decode_mask: torch.Tensor | None
    decode_context: int  # keys each decode reads (padded to the longest)
    prefills: tuple[PrefillChunk, ...]
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64 context of each decode
    # Where `write_kv` puts each new token, split once per step instead of once per layer;
    # None when the plan was built without a slot mapping.
    slot_blocks: torch.Tensor | None = None  # [T] int64
    slot_offsets: torch.Tensor | None = None  # [T] int64

    @property
    def has_decodes(self) -> bool:
        return self.decode_block_tables is not None

    def to(self, device: torch.device, non_blocking: bool = False) -> AttentionPlan:
        """The plan with every tensor on `device`; its ints (query spans, context lengths)
        stay Python values, so kernels read them without a host sync."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return AttentionPlan(
            move(self.decode_token_idx),
            move(self.decode_block_tables),
            move(self.decode_mask),
            self.decode_context,
            tuple(c.to(device, non_blocking) for c in self.prefills),
            move(self.decode_lens),
            move(self.slot_blocks),
            move(self.slot_offsets),
        )


def split_slots(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots -> (block ids, offsets), dropping negative (padding) slots' tokens is the caller's
    job: see `write_kv`."""
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    return blocks, slot_mapping - blocks * block_size


def build_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor | None = None,
) -> AttentionPlan:
    """Digest the step's metadata (see `paged_attention` for the meaning of each argument).

    With `slot_mapping` (no negative slots), `write_kv` reuses its block / offset split.
    """
    slot_blocks = slot_offsets = None
    if slot_mapping is not None and (slot_mapping.numel() == 0 or int(slot_mapping.min()) >= 0):
        slot_blocks, slot_offsets = split_slots(slot_mapping.to(torch.int64), block_size)
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
        return AttentionPlan(None, None, None, 0, tuple(prefills), None, slot_blocks, slot_offsets)
    dec_lens = [lens[i] for i in decode_seqs]
    longest = max(dec_lens)
    max_blocks = -(-longest // block_size)
    seq_idx = torch.tensor(decode_seqs, dtype=torch.int64)
    tables = block_tables[seq_idx, :max_blocks].to(torch.int64)
    mask = None
    lens_t = torch.tensor(dec_lens, dtype=torch.int64)
    if min(dec_lens) != longest:
        positions = torch.arange(longest)
        mask = (positions.unsqueeze(0) < lens_t.unsqueeze(1)).view(len(decode_seqs), 1, 1, -1)
    rows = None
    if decode_rows != list(range(starts[-1])):
        rows = torch.tensor(decode_rows, dtype=torch.int64)
    return AttentionPlan(
        rows, tables, mask, longest, tuple(prefills), lens_t, slot_blocks, slot_offsets
    )
