"""Mixed batches for the decode / prefill split, and kernels stand-ins built on the torch
reference that record which rows each kind was given."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay_kernels import reference

# (seq_lens, q_lens): decodes first (spans), prefills first, interleaved (index tensors),
# all decodes, all prefills, a single row of each.
MIXED_CASES = [
    ([9, 30, 12, 17], [1, 1, 7, 17]),
    ([12, 5, 20, 8], [12, 5, 1, 1]),
    ([9, 30, 4, 17, 6], [1, 7, 1, 17, 1]),
    ([40, 3, 19], [1, 1, 1]),
    ([8, 21], [3, 21]),
    ([5, 2], [1, 2]),
]


@dataclass
class Recorder:
    """Reference-backed decode and varlen kernels with the `split.py` signatures."""

    kv_cache: torch.Tensor
    layer: int
    scale: float
    decode_rows: list[int] = field(default_factory=list)  # how many rows each call got
    prefill_q_lens: list[list[int]] = field(default_factory=list)

    def decode(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        assert query.shape[0] == seq_lens.shape[0] == block_tables.shape[0]
        self.decode_rows.append(query.shape[0])
        qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32)
        result = reference.paged_attention(
            query, self.kv_cache, self.layer, block_tables, seq_lens, qsl, self.scale
        )
        if out is None:
            return result
        assert out.is_contiguous()
        return out.copy_(result)

    def prefill(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Computes rows `query_start_loc[0]:query_start_loc[-1]` only (absolute offsets)."""
        first, last = int(query_start_loc[0]), int(query_start_loc[-1])
        self.prefill_q_lens.append((query_start_loc[1:] - query_start_loc[:-1]).tolist())
        result = reference.paged_attention(
            query[first:last],
            self.kv_cache,
            self.layer,
            block_tables,
            seq_lens,
            query_start_loc - first,
            self.scale,
        )
        if out is None:
            out = torch.full_like(query, float("nan"))
        out[first:last] = result
        return out
