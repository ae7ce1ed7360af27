"""The CPU backend's sliding window and soft cap (decode rows in C++, prefill chunks by the
reference) against the torch reference, and the kernel never reading outside the window."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import build_plan, cpu_backend, reference, select_backend
from tests.kernels.variant_cases import MIXED_CASES, SOFT_CAPS, WINDOWS, VariantCase, decode_only

pytestmark = pytest.mark.skipif(
    not cpu_backend.is_available(), reason="the CPU kernel does not build here"
)
QUERY_GAIN = 3.0  # scores of a few units: the caps bend them (test_attention_variants.py)


def _compare(case: VariantCase, dtype: torch.dtype, window: int | None, cap: float | None) -> None:
    batch = case.batch(len(case.seq_lens) + case.block_size, dtype)
    query = batch.query * QUERY_GAIN
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    plan = build_plan(*args, case.block_size)
    scale = case.head_dim**-0.5
    got = cpu_backend.paged_attention(
        query, batch.kv_cache, 1, *args, scale, plan=plan, sliding_window=window, soft_cap=cap
    )
    assert got.dtype == dtype
    # bf16: the kernel widens to fp32 and rounds once, so it is held to the fp32 reference over
    # the same bf16 inputs within one bf16 rounding (as test_cpu_backend.py).
    expected = reference.paged_attention(
        query.float(), batch.kv_cache.float(), 1, *args, scale, plan=plan,
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize("case", [*MIXED_CASES, *map(decode_only, MIXED_CASES)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_windows_match_the_reference(
    case: VariantCase, window: int | None, dtype: torch.dtype
) -> None:
    for cap in (None, 5.0):
        _compare(case, dtype, window, cap)


@pytest.mark.parametrize("case", [*MIXED_CASES, *map(decode_only, MIXED_CASES)])
@pytest.mark.parametrize("cap", SOFT_CAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_soft_caps_match_the_reference(
    case: VariantCase, cap: float | None, dtype: torch.dtype
) -> None:
    for window in (None, 17):
        _compare(case, dtype, window, cap)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 100])
def test_the_kernel_reads_nothing_before_the_window(threads: int, window: int) -> None:
    """Every key and value before each decode's window is NaN: one read of them would poison
    the output. With fewer sequences than threads each KV head is an item of its own."""
    case = VariantCase((70, 3, 40, 33), (1, 1, 1, 1), 16, 3, 3, 64)
    batch = case.batch(4)
    poisoned = batch.kv_cache.clone()
    for table, context in zip(batch.tables, case.seq_lens, strict=True):
        for pos in range(max(0, context - window)):
            poisoned[table[pos // case.block_size], :, :, pos % case.block_size] = float("nan")
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_backend.paged_attention(
            batch.query, poisoned, 1, *args, 0.125, sliding_window=window, soft_cap=20.0
        )
    finally:
        torch.set_num_threads(before)
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, 1, *args, 0.125, sliding_window=window, soft_cap=20.0
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_kernels_zero_means_none_and_the_plain_call_is_unchanged() -> None:
    case = decode_only(MIXED_CASES[0])
    batch = case.batch(2, torch.bfloat16)
    module = cpu_backend.load_extension()
    assert module is not None
    args = (batch.query, batch.kv_cache, 0, batch.block_tables.long(), batch.seq_lens.long(), 0.3)
    plain = module.paged_decode_attention(*args)
    assert torch.equal(module.paged_decode_attention(*args, 0, 0.0), plain)
    assert torch.equal(module.paged_decode_attention(*args, sliding_window=10_000), plain)
    qsl = batch.query_start_loc
    assert torch.equal(
        cpu_backend.paged_attention(batch.query, batch.kv_cache, 0, *args[3:5], qsl, 0.3), plain
    )
    windowed = module.paged_decode_attention(*args, sliding_window=4)
    capped = module.paged_decode_attention(*args, soft_cap=0.5)
    assert not torch.equal(windowed, plain) and not torch.equal(capped, plain)


def test_the_kernel_refuses_negative_variants() -> None:
    batch = decode_only(MIXED_CASES[3]).batch(0)
    module = cpu_backend.load_extension()
    assert module is not None
    args = (batch.query, batch.kv_cache, 0, batch.block_tables.long(), batch.seq_lens.long(), 0.3)
    for kwargs in ({"sliding_window": -1}, {"soft_cap": -2.0}, {"soft_cap": float("inf")}):
        with pytest.raises(RuntimeError, match=r"sliding_window .* soft_cap"):
            module.paged_decode_attention(*args, **kwargs)


def test_the_backend_refuses_out_of_domain_variants_by_name() -> None:
    batch = MIXED_CASES[0].batch(0)
    args = (batch.query, batch.kv_cache, 0, batch.block_tables, batch.seq_lens)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_backend.paged_attention(*args, batch.query_start_loc, 0.3, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        cpu_backend.paged_attention(*args, batch.query_start_loc, 0.3, soft_cap=-1.0)


def test_the_cpu_backend_says_it_implements_both() -> None:
    backend = select_backend("cpu")
    assert backend.sliding_window and backend.soft_cap
    backend.check_supports(sliding_window=True, soft_cap=True)
