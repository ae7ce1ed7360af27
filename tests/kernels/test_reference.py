"""The torch reference ops against a plain per-token loop: mixed batches, GQA, partial blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay_kernels import build_plan, copy_blocks, paged_attention, select_backend, write_kv
from tests.kernels.paged_batch import make_paged_batch


def naive_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    tables: list[list[int]],
    seq_lens: list[int],
    q_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """One query token, one head at a time: the definition of paged causal attention."""
    block_size = kv_cache.shape[3]
    group = query.shape[1] // kv_cache.shape[4]
    out = torch.empty_like(query)
    row = 0
    for table, context, q_len in zip(tables, seq_lens, q_lens, strict=True):
        slots = [(table[p // block_size], p % block_size) for p in range(context)]
        keys = torch.stack([kv_cache[b, layer, 0, o] for b, o in slots])
        values = torch.stack([kv_cache[b, layer, 1, o] for b, o in slots])
        for i in range(q_len):
            visible = context - q_len + i + 1
            for head in range(query.shape[1]):
                kv_head = head // group
                scores = keys[:visible, kv_head] @ query[row, head] * scale
                out[row, head] = torch.softmax(scores, 0) @ values[:visible, kv_head]
            row += 1
    return out


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([8, 16]),
)
def test_paged_attention_matches_the_loop(
    data: st.DataObject, block_size: int, kv_heads: int, group: int, head_dim: int
) -> None:
    num_seqs = data.draw(st.integers(1, 5))
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs))
    # Each sequence is a decode (1 query), a chunk of its tail, or a whole prompt.
    q_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    batch = make_paged_batch(
        seq_lens,
        q_lens,
        block_size,
        kv_heads,
        group,
        head_dim,
        seed=data.draw(st.integers(0, 2**16)),
    )
    query, kv_cache, block_tables = batch.query, batch.kv_cache, batch.block_tables
    lens, qsl, tables = batch.seq_lens, batch.query_start_loc, batch.tables
    scale = head_dim**-0.5

    out = paged_attention(query, kv_cache, 1, block_tables, lens, qsl, scale)
    expected = naive_attention(query, kv_cache, 1, tables, seq_lens, q_lens, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plan = build_plan(block_tables, lens, qsl, block_size)
    again = paged_attention(query, kv_cache, 1, block_tables, lens, qsl, scale, plan=plan)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_write_kv_fills_exactly_the_given_slots() -> None:
    kv_cache = torch.zeros(4, 3, 2, 4, 2, 8)
    slots = torch.tensor([5, 0, 15, -1])  # block 1 offset 1, block 0 offset 0, block 3 offset 3
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    write_kv(key, value, kv_cache, 2, slots)
    torch.testing.assert_close(kv_cache[1, 2, 0, 1], key[0])
    torch.testing.assert_close(kv_cache[0, 2, 1, 0], value[1])
    torch.testing.assert_close(kv_cache[3, 2, 0, 3], key[2])
    written = (kv_cache != 0).any(-1).any(-1).sum()
    assert int(written) == 6  # 3 slots (the -1 padding is skipped) x K and V, layer 2 only
    assert not kv_cache[:, :2].any()


def test_copy_blocks_copies_every_layer() -> None:
    kv_cache = torch.randn(5, 3, 2, 4, 2, 8)
    before = kv_cache.clone()
    copy_blocks(kv_cache, torch.tensor([0, 2]), torch.tensor([4, 1]))
    torch.testing.assert_close(kv_cache[4], before[0])
    torch.testing.assert_close(kv_cache[1], before[2])
    torch.testing.assert_close(kv_cache[[0, 2, 3]], before[[0, 2, 3]])


def test_backend_selection() -> None:
    assert select_backend("auto").name in ("cpu", "torch")
    assert select_backend("torch").paged_attention is paged_attention
    with pytest.raises(ValueError, match="not available"):
        select_backend("cuda")


@pytest.mark.parametrize("seq_lens", [[5, 5, 5], [1, 9, 4], [16]])
def test_all_decode_steps_take_the_fast_path_and_match(seq_lens: list[int]) -> None:
    block_size, kv_heads, group, head_dim = 4, 2, 3, 8
    blocks_each = [-(-n // block_size) for n in seq_lens]
    kv_cache = torch.randn(sum(blocks_each) + 1, 1, 2, block_size, kv_heads, head_dim)
    tables, start = [], 1
    for count in blocks_each:
        tables.append(list(range(start, start + count)))
        start += count
    width = max(blocks_each)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    plan = build_plan(block_tables, lens, qsl, block_size)
    assert plan.decode_token_idx is None  # rows in order: no gather / scatter
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim)
    out = paged_attention(query, kv_cache, 0, block_tables, lens, qsl, 0.3, plan=plan)
    expected = naive_attention(query, kv_cache, 0, tables, seq_lens, [1] * len(seq_lens), 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_with_a_plan_reuses_its_slot_split() -> None:
    kv_cache = torch.zeros(4, 2, 2, 4, 1, 2)
    slots = torch.tensor([6, 1])
    plan = build_plan(
        torch.tensor([[1, 0]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        4,
        slot_mapping=slots,
    )
    assert plan.slot_blocks is not None and plan.slot_blocks.tolist() == [1, 0]
    key = torch.ones(2, 1, 2)
    write_kv(key, -key, kv_cache, 1, slots, plan=plan)
    assert kv_cache[1, 1, 0, 2].tolist() == [[1.0, 1.0]]
    assert kv_cache[0, 1, 1, 1].tolist() == [[-1.0, -1.0]]
    assert int((kv_cache != 0).sum()) == 8
