"""Random paged-attention batches for kernel tests: shuffled block tables, mixed query lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [sum(q_lens), kv_heads * group, head_dim]
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, zero-padded
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    tables: list[list[int]]  # the same block ids, unpadded


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    *,
    num_layers: int = 2,
    seed: int = 0,
) -> PagedBatch:
    """Sequence i owns `seq_lens[i]` context tokens in shuffled blocks and queries its last
    `q_lens[i]`; two spare blocks are never referenced."""
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each) + 2
    kv_cache = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for count in blocks_each:
        tables.append(perm[start : start + count])
        start += count
    width = max(blocks_each)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedBatch(query, kv_cache, block_tables, lens, qsl, tables)
