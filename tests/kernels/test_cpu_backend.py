"""kvrelay's C++ CPU decode attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import build_plan, cpu_backend, reference, select_backend

pytestmark = pytest.mark.skipif(
    not cpu_backend.is_available(), reason="the CPU kernel does not build here"
)


def make_batch(
    seq_lens: list[int], q_lens: list[int], block_size: int, kv_heads: int, group: int, dim: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(sum(seq_lens) + block_size)
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each) + 2
    kv_cache = torch.randn(num_blocks, 3, 2, block_size, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for count in blocks_each:
        tables.append(perm[start : start + count])
        start += count
    width = max(blocks_each)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(sum(q_lens), kv_heads * group, dim, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, kv_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([1], [1]),
        ([37, 5, 16, 64], [1, 1, 1, 1]),  # all decodes, unequal lengths
        ([9, 30, 4], [1, 7, 1]),  # decodes mixed with a prefill chunk
    ],
)
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "dim"), [(4, 2, 3, 8), (16, 3, 3, 64), (16, 1, 8, 20)]
)
def test_cpu_backend_matches_the_reference(
    seq_lens: list[int], q_lens: list[int], block_size: int, kv_heads: int, group: int, dim: int
) -> None:
    query, kv_cache, tables, lens, qsl = make_batch(
        seq_lens, q_lens, block_size, kv_heads, group, dim
    )
    plan = build_plan(tables, lens, qsl, block_size)
    for layer in (0, 2):
        expected = reference.paged_attention(
            query, kv_cache, layer, tables, lens, qsl, 0.3, plan=plan
        )
        got = cpu_backend.paged_attention(query, kv_cache, layer, tables, lens, qsl, 0.3, plan=plan)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_auto_selects_the_cpu_backend() -> None:
    assert select_backend("auto").name == "cpu"
    assert select_backend("torch").name == "torch"
