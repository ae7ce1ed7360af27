"""Per-step attention metadata that the runner builds once and every decoder layer reads.

Plain tensors plus the kernel plan; this file must not compute anything per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay_kernels import AttentionPlan, build_plan


@dataclass(frozen=True)
class AttentionInputs:
    """Where one step's new tokens go in the paged KV cache and what each query attends to.

    The batch is a flattened run of query chunks: sequence `i` owns query rows
    `query_start_loc[i]:query_start_loc[i+1]` (a prefill chunk, or one decode token), which
    are the last rows of its `seq_lens[i]` context tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32, block ids of each sequence (padded)
    seq_lens: torch.Tensor  # [S] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query offsets
    plan: AttentionPlan  # the same metadata digested once per step for the kernels

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        num_blocks: int | None = None,
    ) -> AttentionInputs:
        """Bundle the step's metadata (host tensors) and digest it into a plan (once, not once
        per layer). With `num_blocks`, every slot is checked to lie inside the cache, here on
        the host, so the device kernels never need to (nor sync to).

        Raises:
            ValueError: the shapes disagree (the message names the tensors to fix), or a slot
                is past the cache.
        """
        num_seqs = seq_lens.shape[0]
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc must have len(seq_lens) + 1 = {num_seqs + 1} entries, "
                f"got {query_start_loc.shape[0]}"
            )
        if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
                f"got {tuple(block_tables.shape)}"
            )
        num_tokens = int(query_start_loc[-1]) if num_seqs else 0
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"slot_mapping must have one slot per query token ({num_tokens}), "
                f"got {slot_mapping.shape[0]}"
            )
        num_slots = None if num_blocks is None else num_blocks * block_size
        plan = build_plan(
            block_tables, seq_lens, query_start_loc, block_size, slot_mapping, num_slots=num_slots
        )
        return cls(slot_mapping, block_tables, seq_lens, query_start_loc, plan)

    def to(self, device: torch.device, non_blocking: bool = False) -> AttentionInputs:
        """The same inputs on `device` (the plan's tensors too); `self` when already there."""
        if self.slot_mapping.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return AttentionInputs(
            move(self.slot_mapping),
            move(self.block_tables),
            move(self.seq_lens),
            move(self.query_start_loc),
            self.plan.to(device, non_blocking),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
