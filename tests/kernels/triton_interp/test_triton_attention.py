"""Triton paged attention and write_kv (interpreted on the CPU) against the torch reference.

Inputs are fresh random on every run (the seed is in the failure message); outputs are
poisoned with NaN before each call, so a row the kernel forgets to write fails the test.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from kvrelay_kernels import build_plan, reference
from kvrelay_kernels.triton_attention import paged_attention
from kvrelay_kernels.triton_write_kv import write_kv
from tests.kernels.paged_batch import make_paged_batch

# bf16 keeps 8 bits of mantissa: the kernel rounds q, k, v and the probabilities to it.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def _batches(block_size: int) -> list[tuple[list[int], list[int]]]:
    """(context lengths, query lengths): partial last blocks everywhere."""
    b = block_size
    return [
        # decodes, a prefill chunk at a context offset, a whole prompt
        ([b + 3, 2 * b + 5, 7, b - 1], [1, b + 2, 7, 1]),
        ([3 * b + 1, 1, b + 9], [1, 1, 1]),  # decode only (the small-tile path)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_triton_paged_attention_matches_the_reference(
    group: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    kv_heads = 2 if group < 8 else 1
    for seq_lens, q_lens in _batches(block_size):
        seed = secrets.randbelow(2**31)
        batch = make_paged_batch(
            seq_lens, q_lens, block_size, kv_heads, group, head_dim, num_layers=2, seed=seed
        )
        query, kv_cache = batch.query.to(dtype), batch.kv_cache.to(dtype)
        tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
        scale = head_dim**-0.5
        plan = build_plan(tables, lens, qsl, block_size)
        # The reference in fp32 on the same (rounded) inputs: the bar is the exact answer.
        expected = reference.paged_attention(
            query.float(), kv_cache.float(), 1, tables, lens, qsl, scale, plan=plan
        )
        for use_plan in (True, False):
            out = torch.full_like(query, float("nan"))
            got = paged_attention(
                query, kv_cache, 1, tables, lens, qsl, scale, plan=plan if use_plan else None,
                out=out,
            )  # fmt: skip
            assert got.data_ptr() == out.data_ptr()
            assert not got.isnan().any(), f"rows left unwritten (seed {seed})"
            atol, rtol = TOLERANCE[dtype]
            torch.testing.assert_close(
                got.float(), expected, atol=atol, rtol=rtol, msg=lambda m, s=seed: f"{m} seed {s}"
            )


def test_triton_reads_a_strided_query_and_layer_view() -> None:
    """The model passes q as a view of its fused qk tensor; any layer of the cache is read."""
    seed = secrets.randbelow(2**31)
    batch = make_paged_batch([20, 9], [4, 1], 16, 2, 3, 64, num_layers=3, seed=seed)
    fused = torch.randn(5, 6 + 2, 64)
    fused[:, :6] = batch.query
    query = fused[:, :6]  # [T, 6, 64], row stride 8 * 64
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    expected = reference.paged_attention(batch.query, batch.kv_cache, 2, tables, lens, qsl, 0.2)
    got = paged_attention(query, batch.kv_cache, 2, tables, lens, qsl, 0.2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5, msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_write_kv_matches_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(secrets.randbelow(2**31))
    num_blocks, layers, block_size, kv_heads, head_dim = 6, 3, 16, 3, 64
    shape = (num_blocks, layers, 2, block_size, kv_heads, head_dim)
    poison = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
    slots[4] = -1  # a padding token: must be skipped
    # key / value as strided views of one fused tensor in the cache dtype, as the model hands
    # them over: the copy must then be bit exact.
    kv = torch.randn(9, 2 * kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv[:, :kv_heads], kv[:, kv_heads:]
    expected = poison.clone()
    reference.write_kv(key, value, expected, 1, slots)
    got = poison.clone()
    write_kv(key, value, got, 1, slots)
    # NaN == NaN here: untouched slots must stay exactly as they were.
    torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)
    assert int((~got.isnan()).sum()) == 8 * 2 * kv_heads * head_dim
