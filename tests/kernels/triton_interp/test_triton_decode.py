"""Triton's decode entry (`triton_attention.decode_attention`, what the decode dispatch calls
instead of the CUDA kernel) interpreted on the CPU against the torch reference: GQA groups,
partial blocks, windows and caps, a strided query, a row subset as a split step hands it, and
the cached query offsets that CUDA graphs keep reading.

Outputs are poisoned with NaN first, so a row the kernel forgets to write fails the test.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import torch

from kvrelay_kernels import build_plan, reference
from kvrelay_kernels.triton_attention import decode_attention, decode_offsets
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def expected_of(
    batch: PagedBatch, dtype: torch.dtype, layer: int, scale: float, **variant: Any
) -> torch.Tensor:
    """The reference in fp32 on the same (rounded) inputs."""
    query, kv = batch.query.to(dtype).float(), batch.kv_cache.to(dtype).float()
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, kv.shape[3])
    return reference.paged_attention(
        query, kv, layer, tables, lens, qsl, scale, plan=plan, **variant
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize(
    "variant", [{}, {"sliding_window": 5}, {"soft_cap": 2.0}], ids=["plain", "window", "cap"]
)
def test_decode_attention_matches_the_reference(
    group: int, dtype: torch.dtype, variant: dict[str, Any]
) -> None:
    seed = secrets.randbelow(2**31)
    seq_lens = [17, 1, 40, 16]
    batch = make_paged_batch(seq_lens, [1] * 4, 16, 2 if group < 8 else 1, group, 64, seed=seed)
    query, kv_cache = batch.query.to(dtype), batch.kv_cache.to(dtype)
    expected = expected_of(batch, dtype, 1, 0.125, **variant)
    out = torch.full_like(query, float("nan"))
    got = decode_attention(
        query, kv_cache, 1, batch.block_tables, batch.seq_lens, 0.125, out, **variant
    )
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), f"rows left unwritten (seed {seed})"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        got.float(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{m} seed {seed}"
    )


def test_a_strided_query_and_no_out() -> None:
    """A split step hands the decode rows as views; without `out` one is allocated."""
    seed = secrets.randbelow(2**31)
    batch = make_paged_batch([20, 33, 5], [1, 1, 1], 16, 2, 3, 64, num_layers=3, seed=seed)
    fused = torch.randn(3, 6 + 2, 64)
    fused[:, :6] = batch.query
    got = decode_attention(fused[:, :6], batch.kv_cache, 2, batch.block_tables,
                           batch.seq_lens, 0.2)  # fmt: skip
    expected = expected_of(batch, torch.float32, 2, 0.2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5, msg=f"seed {seed}")


def test_a_subset_of_the_sequences_reads_its_own_rows() -> None:
    seed = secrets.randbelow(2**31)
    batch = make_paged_batch([20, 33, 5, 50], [1] * 4, 16, 2, 2, 64, seed=seed)
    expected = expected_of(batch, torch.float32, 0, 0.2)
    got = decode_attention(batch.query[1:3], batch.kv_cache, 0, batch.block_tables[1:3],
                           batch.seq_lens[1:3], 0.2)  # fmt: skip
    torch.testing.assert_close(got, expected[1:3], atol=2e-5, rtol=2e-5, msg=f"seed {seed}")


def test_no_sequence_launches_nothing() -> None:
    batch = make_paged_batch([5], [1], 16, 2, 2, 64)
    empty = batch.query[:0]
    got = decode_attention(empty, batch.kv_cache, 0, batch.block_tables[:0],
                           batch.seq_lens[:0], 0.2)  # fmt: skip
    assert got.shape == (0, 4, 64)


def test_bad_variants_and_a_strided_head_dim_are_refused() -> None:
    batch = make_paged_batch([5], [1], 16, 2, 2, 64)
    args = (batch.query, batch.kv_cache, 0, batch.block_tables, batch.seq_lens, 0.2)
    with pytest.raises(ValueError, match="sliding_window must be an int >= 1"):
        decode_attention(*args, sliding_window=0)
    strided = batch.kv_cache.transpose(4, 5)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        decode_attention(batch.query, strided, 0, batch.block_tables, batch.seq_lens, 0.2)


def test_offsets_are_views_of_a_range_kept_for_good() -> None:
    """A captured graph keeps reading the range it was captured with: a larger one is added,
    the smaller never freed, and a size within it reuses its memory."""
    device = torch.device("cpu")
    first = decode_offsets(3, device)
    assert first.tolist() == [0, 1, 2, 3] and first.dtype == torch.int32
    again = decode_offsets(10, device)
    assert again.data_ptr() == first.data_ptr()  # 64 made at once
    bigger = decode_offsets(100, device)
    assert bigger.tolist() == list(range(101)) and bigger.data_ptr() != first.data_ptr()
    assert first.tolist() == [0, 1, 2, 3]  # still alive, still right
    assert decode_offsets(3, device).data_ptr() == bigger.data_ptr()
