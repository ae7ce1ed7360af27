"""CUDA-graph bookkeeping that needs no GPU: which batch sizes are captured, which steps may
replay one, and the padded static inputs a replay reads (issue 14).

A graph replays fixed shapes and addresses, so a decode step of `n` sequences runs in the
graph of the smallest captured size `b >= n`: its inputs are copied into static buffers and
rows `n:b` are padding that must not disturb the real rows: token 0 at position 0, slot -1
(`write_kv` writes nowhere), context length 1 (the decode kernel reads one valid key: block
table entries always hold valid block ids, so padded rows read real memory, never outside).
Every op of the forward pass is row-wise apart from attention, which reads only the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay_kernels import AttentionPlan

PAD_TOKEN = 0
PAD_SLOT = -1  # write_kv skips it in every backend
PAD_SEQ_LEN = 1
_KEPT_VIEWS = 64  # views kept by `StaticDecodeInputs`; all dropped past this
# Rows of input_ids, positions, slot_mapping and seq_lens (or none).
_Rows = tuple[torch.Tensor, ...]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below `max_num_seqs`, then `max_num_seqs` itself: every decode step the
    scheduler can produce has a graph."""
    sizes: list[int] = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None when none does."""
    return next((s for s in sizes if s >= num_seqs), None) if num_seqs > 0 else None


def replays(plan: AttentionPlan, num_tokens: int, sizes: list[int]) -> int | None:
    """The captured size a step replays, or None when it runs eagerly: only pure decode steps
    (one token per sequence, no prefill chunk) with a captured size that holds them."""
    if plan.prefills or not plan.has_decodes or plan.decode_rows != (0, num_tokens):
        return None
    return padded_size(num_tokens, sizes)


@dataclass
class StaticDecodeInputs:
    """The buffers a captured graph reads, for up to `max_size` decodes, on `device`."""

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64
    seq_lens: torch.Tensor  # [max_size] int32
    query_start_loc: torch.Tensor  # [max_size + 1] int32: 0, 1, 2, ... (one token each)
    block_tables: torch.Tensor  # [max_size, max_blocks] int32
    # Views `load` copies into, kept by rows and padded size (and table width): `_slices`.
    _views: dict[tuple[int, int], tuple[_Rows, _Rows]] = field(default_factory=dict, repr=False)
    _table_views: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> StaticDecodeInputs:
        """Buffers holding an all-padding batch (what the graphs are captured with)."""

        def full(n: int, value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((n,), value, dtype=dtype, device=device)

        return cls(
            input_ids=full(max_size, PAD_TOKEN, torch.int64),
            positions=full(max_size, 0, torch.int64),
            slot_mapping=full(max_size, PAD_SLOT, torch.int64),
            seq_lens=full(max_size, PAD_SEQ_LEN, torch.int32),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_size, max_blocks, dtype=torch.int32, device=device),
        )

    def load(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> None:
        """Copy a decode step of `n = len(input_ids)` rows in and pad rows `n:size` (device
        copies and fills only: no sync). Table columns past the step's width keep older
        entries, which are never read: a row reads only its own context's blocks."""
        n = input_ids.shape[0]
        heads, tails = self._slices(n, size)
        for head, values in zip(heads, (input_ids, positions, slot_mapping, seq_lens), strict=True):
            head.copy_(values)
        self._table_head(n, block_tables.shape[1]).copy_(block_tables)
        for tail, pad in zip(tails, (PAD_TOKEN, 0, PAD_SLOT, PAD_SEQ_LEN), strict=False):
            tail.fill_(pad)  # none when size == n

    def _slices(self, n: int, size: int) -> tuple[_Rows, _Rows]:
        """Rows `:n` and `n:size` (none when `size == n`) of input_ids, positions,
        slot_mapping and seq_lens, made once per `(n, size)` (each slice is a device op,
        ~5 us of host time on a GPU; a decode step's batch size rarely changes)."""
        slices = self._views.get((n, size))
        if slices is None:
            if len(self._views) >= _KEPT_VIEWS:
                self._views.clear()
            buffers = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens)
            tails = tuple(b[n:size] for b in buffers) if size > n else ()
            slices = self._views[(n, size)] = (tuple(b[:n] for b in buffers), tails)
        return slices

    def _table_head(self, n: int, width: int) -> torch.Tensor:
        """`block_tables[:n, :width]`, made once per shape (a width lasts block_size steps)."""
        head = self._table_views.get((n, width))
        if head is None:
            if len(self._table_views) >= _KEPT_VIEWS:
                self._table_views.clear()
            head = self._table_views[(n, width)] = self.block_tables[:n, :width]
        return head

    def plan(
        self, size: int, max_model_len: int, partitions: int, workspace: torch.Tensor | None
    ) -> AttentionPlan:
        """The plan a graph of `size` decodes is captured with, for the CUDA decode kernel:
        every row a decode, contexts up to `max_model_len` (so split-K is sized for the worst
        case) with a fixed partition count and scratch. Not a plan for the torch reference
        (its decode mask would be built at capture from the padded lengths): graphs run only
        where the CUDA kernel does."""
        return AttentionPlan(
            decode_token_idx=None,
            decode_block_tables=self.block_tables[:size],
            decode_context=max_model_len,
            prefills=(),
            decode_lens=self.seq_lens[:size],
            decode_rows=(0, size),
            decode_seqs=(0, size),
            decode_partitions=partitions,
            decode_workspace=workspace,
        )
