"""The decode / prefill split (split.py, plan.py): each kind's kernel sees exactly its rows,
the result equals the reference's for the whole batch, and padded or out-of-range slots are
handled on the host."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import build_plan, reference, select_backend
from kvrelay_kernels.plan import check_slots
from kvrelay_kernels.split import split_attention
from tests.kernels.paged_batch import make_paged_batch
from tests.kernels.split_cases import MIXED_CASES, Recorder


@pytest.mark.parametrize(("seq_lens", "q_lens"), MIXED_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_split_equals_the_reference_and_each_kernel_gets_its_rows(
    seq_lens: list[int], q_lens: list[int], seed: int
) -> None:
    batch = make_paged_batch(seq_lens, q_lens, 4, 2, 3, 8, num_layers=2, seed=seed)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, 4)
    expected = reference.paged_attention(batch.query, batch.kv_cache, 1, tables, lens, qsl, 0.3)
    kernels = Recorder(batch.kv_cache, 1, 0.3)
    out = torch.full_like(batch.query, float("nan"))
    got = split_attention(
        batch.query, tables, lens, qsl, plan, out, kernels.decode, kernels.prefill
    )
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    num_decodes = q_lens.count(1)
    assert kernels.decode_rows == ([num_decodes] if num_decodes else [])
    prefill_lens = [n for n in q_lens if n > 1]
    assert kernels.prefill_q_lens == ([prefill_lens] if prefill_lens else [])


def test_plan_spans_and_indices() -> None:
    """Contiguous kinds become spans (views, no copies); interleaved kinds index tensors."""
    batch = make_paged_batch([9, 30, 12, 17], [1, 1, 7, 17], 4, 1, 1, 8)
    plan = build_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, 4)
    assert (plan.decode_rows, plan.decode_seqs) == ((0, 2), (0, 2))
    assert (plan.prefill_rows, plan.prefill_seqs) == ((2, 26), (2, 4))
    assert plan.decode_seq_idx is None and plan.prefill_token_idx is None
    batch = make_paged_batch([9, 30, 4, 17, 6], [1, 7, 1, 17, 1], 4, 1, 1, 8)
    plan = build_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, 4)
    assert plan.decode_rows is None and plan.decode_seq_idx is not None
    assert plan.decode_seq_idx.tolist() == [0, 2, 4]
    assert plan.prefill_seqs is None and plan.prefill_seq_idx is not None
    assert plan.prefill_seq_idx.tolist() == [1, 3]
    assert plan.prefill_token_idx is not None
    assert plan.prefill_token_idx.tolist() == [*range(1, 8), *range(9, 26)]
    assert plan.prefill_query_start_loc is not None
    assert plan.prefill_query_start_loc.tolist() == [0, 7, 24]


def test_plan_tensors_move_together() -> None:
    batch = make_paged_batch([9, 30, 4, 17, 6], [1, 7, 1, 17, 1], 4, 1, 1, 8)
    plan = build_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, 4)
    moved = plan.to(torch.device("meta"))
    assert all(t.is_meta for t in moved.tensors())
    assert len(moved.tensors()) == len(plan.tensors()) >= 8
    assert (moved.decode_context, moved.prefill_rows) == (plan.decode_context, plan.prefill_rows)


def _write_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    cache = torch.full((4, 2, 2, 4, 2, 8), float("nan"))
    slots = torch.tensor([5, -1, 0, -1, 15, -1])  # -1: padded rows (a CUDA graph's spares)
    key = torch.randn(6, 2, 8, generator=gen)
    value = torch.randn(6, 2, 8, generator=gen)
    return cache, slots, key, value


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("with_plan", [True, False])
def test_padded_slots_write_nowhere(backend: str, with_plan: bool) -> None:
    if backend not in ("torch", *[select_backend("auto").name]):
        pytest.skip(f"{backend} backend not available here")
    cache, slots, key, value = _write_case()
    plan = None
    if with_plan:
        plan = build_plan(
            torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
            torch.tensor([0, 6], dtype=torch.int32),
            4,
            slot_mapping=slots,
            num_slots=16,
        )
        assert plan.slot_keep is not None and plan.slot_keep.tolist() == [0, 2, 4]
    select_backend(backend).write_kv(key, value, cache, 1, slots, plan=plan)
    assert int((~cache.isnan()).sum()) == 3 * 2 * 2 * 8  # three real tokens, K and V
    torch.testing.assert_close(cache[1, 1, 0, 1], key[0])
    torch.testing.assert_close(cache[0, 1, 1, 0], value[2])
    torch.testing.assert_close(cache[3, 1, 0, 3], key[4])


def test_slots_are_checked_on_the_host() -> None:
    assert check_slots(torch.tensor([0, 15, -1]), 16) is True
    assert check_slots(torch.tensor([0, 15]), 16) is False
    assert check_slots(torch.tensor([], dtype=torch.int64), 16) is False
    with pytest.raises(ValueError, match="outside the KV cache"):
        check_slots(torch.tensor([3, 16]), 16)
    with pytest.raises(ValueError, match="outside the KV cache"):
        build_plan(
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            4,
            slot_mapping=torch.tensor([64]),
            num_slots=64,
        )
