"""Sliding-window and soft-cap attention cases for every backend's tests: a dense fp64
definition to compare against, and paged batches that cross the windows' edges.

The definition is written independently of the reference (a dense score matrix per sequence
with an explicit position mask), so the reference is checked against it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.kernels.paged_batch import PagedBatch, make_paged_batch


def dense_attention(
    batch: PagedBatch,
    layer: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Attention of `batch`'s queries in fp64: query i of a sequence of context c (position
    p = c - q_len + i) sees keys j with j <= p and, with a window W, j > p - W; scores are
    `scale * q.k`, capped as `soft_cap * tanh(s / soft_cap)`."""
    cache = batch.kv_cache.double()
    block_size, kv_heads = cache.shape[3], cache.shape[4]
    group = batch.query.shape[1] // kv_heads
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for seq, table in enumerate(batch.tables):
        context, q0, q1 = int(batch.seq_lens[seq]), starts[seq], starts[seq + 1]
        positions = torch.arange(context)
        blocks, offsets = torch.tensor(table)[positions // block_size], positions % block_size
        keys, values = cache[blocks, layer, 0, offsets], cache[blocks, layer, 1, offsets]
        # keys, values: [context, kv_heads, dim] -> [heads, context, dim]
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)
        values = values.repeat_interleave(group, 1).transpose(0, 1)
        q = batch.query[q0:q1].double().transpose(0, 1)  # [heads, q_len, dim]
        scores = q @ keys.transpose(1, 2) * scale  # [heads, q_len, context]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        own = torch.arange(q1 - q0).unsqueeze(1) + (context - (q1 - q0))
        visible = positions.unsqueeze(0) <= own
        if sliding_window is not None:
            visible &= positions.unsqueeze(0) > own - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    return out


@dataclass(frozen=True)
class VariantCase:
    """One batch shape: each sequence's context and query length (1: a decode row)."""

    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    block_size: int
    kv_heads: int
    group: int
    head_dim: int

    def batch(self, seed: int, dtype: torch.dtype = torch.float32) -> PagedBatch:
        made = make_paged_batch(
            list(self.seq_lens), list(self.q_lens), self.block_size, self.kv_heads,
            self.group, self.head_dim, seed=seed,
        )  # fmt: skip
        return PagedBatch(
            made.query.to(dtype), made.kv_cache.to(dtype), made.block_tables, made.seq_lens,
            made.query_start_loc, made.tables,
        )  # fmt: skip


# Mixed steps (decode rows among prefill chunks, a whole prompt, a chunk of a tail), GQA and
# not, block sizes 1 to 16 and head sizes with and without a vector tail: every window is
# tried on each (smaller than, equal to and larger than the contexts, 1, and on block edges).
MIXED_CASES = (
    VariantCase((37, 5, 64, 17), (1, 5, 1, 6), 16, 2, 2, 32),
    VariantCase((9, 33, 48), (1, 1, 1), 4, 1, 4, 16),
    VariantCase((40, 23, 1, 70), (12, 1, 1, 1), 8, 2, 3, 40),
    VariantCase((16, 31), (16, 1), 1, 3, 1, 8),
)
WINDOWS = (None, 1, 2, 7, 15, 16, 17, 32, 48, 200)
SOFT_CAPS = (None, 0.5, 5.0, 50.0)


def decode_only(case: VariantCase) -> VariantCase:
    """The same contexts with every row a decode."""
    return VariantCase(
        case.seq_lens, (1,) * len(case.seq_lens), case.block_size, case.kv_heads, case.group,
        case.head_dim,
    )  # fmt: skip
