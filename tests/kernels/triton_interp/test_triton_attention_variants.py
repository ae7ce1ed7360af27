"""The Triton varlen kernel's sliding window and soft cap (interpreted on the CPU) against the
torch reference, on mixed steps; outputs are poisoned with NaN before each call, and keys
before every query's window are NaN too, so a read of one fails the test."""

from __future__ import annotations

import secrets

import pytest
import torch

from kvrelay_kernels import build_plan, reference, triton_backend
from kvrelay_kernels.triton_attention import kernel_constants, paged_attention
from tests.kernels.paged_batch import PagedBatch
from tests.kernels.variant_cases import MIXED_CASES, SOFT_CAPS, VariantCase, decode_only

# bf16 keeps 8 bits of mantissa: the kernel rounds q, k, v and the probabilities to it.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}
QUERY_GAIN = 3.0  # scores of a few units: the caps bend them (test_attention_variants.py)
CASES = [*MIXED_CASES, decode_only(MIXED_CASES[0]), decode_only(MIXED_CASES[2])]


def _poison_before_windows(batch: PagedBatch, case: VariantCase, window: int) -> torch.Tensor:
    """The cache with NaN at every position no query of its sequence sees (before the first
    query's window), in every layer."""
    cache = batch.kv_cache.clone()
    for table, context, q_len in zip(batch.tables, case.seq_lens, case.q_lens, strict=True):
        for pos in range(max(0, context - q_len + 1 - window)):
            cache[table[pos // case.block_size], :, :, pos % case.block_size] = float("nan")
    return cache


def _check(
    case: VariantCase, dtype: torch.dtype, window: int | None, cap: float | None, plan: bool
) -> None:
    seed = secrets.randbelow(2**31)
    batch = case.batch(seed, dtype)
    query = (batch.query.float() * QUERY_GAIN).to(dtype)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    step = build_plan(*args, case.block_size)
    scale = case.head_dim**-0.5
    # The reference in fp32 on the same (rounded) inputs: the bar is the exact answer.
    expected = reference.paged_attention(
        query.float(), batch.kv_cache.float(), 1, *args, scale, plan=step,
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip
    cache = batch.kv_cache if window is None else _poison_before_windows(batch, case, window)
    out = torch.full_like(query, float("nan"))
    got = paged_attention(
        query, cache, 1, *args, scale, plan=step if plan else None, out=out,
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip
    assert not got.isnan().any(), f"a NaN: a row unwritten or a key read outside (seed {seed})"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        got.float(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{m} (seed {seed})"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_triton_windows_match_the_reference(case: VariantCase, dtype: torch.dtype) -> None:
    # smaller than, on and past block edges, equal to and longer than the contexts, and 1;
    # every other one with a cap
    for i, window in enumerate((1, 2, 7, 16, 17, 33, 48, 64, 200)):
        _check(case, dtype, window, 5.0 if i % 2 else None, plan=i % 3 != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_triton_soft_caps_match_the_reference(case: VariantCase, dtype: torch.dtype) -> None:
    for cap in SOFT_CAPS:
        _check(case, dtype, None, cap, plan=True)


def test_the_variants_are_constexpr_switches_off_by_default() -> None:
    """Plain attention compiles the kernel it always did: both switches off."""
    plain = kernel_constants(9, 3, 64, 16, torch.bfloat16, True, compiled=True)
    assert plain["HAS_WINDOW"] is False and plain["HAS_CAP"] is False
    both = kernel_constants(
        9, 3, 64, 16, torch.bfloat16, True, compiled=True, sliding_window=True, soft_cap=True
    )
    assert both == plain | {"HAS_WINDOW": True, "HAS_CAP": True}


def test_the_triton_backend_passes_the_variants_on() -> None:
    case = MIXED_CASES[0]
    batch = case.batch(1)
    args = (batch.query, batch.kv_cache, 1, batch.block_tables, batch.seq_lens)
    qsl = batch.query_start_loc
    got = triton_backend.paged_attention(*args, qsl, 0.3, sliding_window=9, soft_cap=1.0)
    expected = reference.paged_attention(*args, qsl, 0.3, sliding_window=9, soft_cap=1.0)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_backend.paged_attention(*args, qsl, 0.3, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_attention(*args, qsl, 0.3, soft_cap=float("nan"))
