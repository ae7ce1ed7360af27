"""Sliding-window attention and soft-capped scores: the torch reference against a dense fp64
definition, the variants' domain checks, and what each backend says it implements."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from kvrelay_kernels import build_plan, reference, select_backend
from kvrelay_kernels.attention_variants import check_variants
from kvrelay_kernels.backend import _BACKENDS
from tests.kernels.variant_cases import (
    MIXED_CASES,
    SOFT_CAPS,
    WINDOWS,
    VariantCase,
    decode_only,
    dense_attention,
)

# Queries three times larger than unit normal: scores of a few units, so a cap of 5 bends
# them and one of 0.5 flattens them (with unit queries no cap below 50 would show).
QUERY_GAIN = 3.0


def _run_reference(
    case: VariantCase, seed: int, window: int | None, cap: float | None, *, plan: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = case.batch(seed)
    query = batch.query * QUERY_GAIN
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    step = build_plan(*args, case.block_size) if plan else None
    got = reference.paged_attention(
        query, batch.kv_cache, 1, *args, case.head_dim**-0.5, plan=step,
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip
    return got, dense_attention(replace(batch, query=query), 1, case.head_dim**-0.5, window, cap)


@pytest.mark.parametrize("case", [*MIXED_CASES, *map(decode_only, MIXED_CASES)])
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_windows_match_the_dense_definition(
    case: VariantCase, window: int | None
) -> None:
    for cap, plan in itertools.product((None, 5.0), (False, True)):
        got, expected = _run_reference(case, 7, window, cap, plan=plan)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.parametrize("cap", SOFT_CAPS)
def test_reference_soft_caps_match_the_dense_definition(
    case: VariantCase, cap: float | None
) -> None:
    got, expected = _run_reference(case, 11, 16, cap, plan=True)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_variants_change_the_output() -> None:
    """The dense definition is not blind to them: a window shorter than the context and a
    cap below the scores each move every long sequence's output (else the tests above could
    not fail)."""
    case = MIXED_CASES[0]
    plain, _ = _run_reference(case, 3, None, None, plan=True)
    windowed, _ = _run_reference(case, 3, 8, None, plan=True)
    capped, _ = _run_reference(case, 3, None, 0.5, plan=True)
    for other in (windowed, capped):
        assert (other - plain).abs().amax() > 0.1


def test_a_window_of_one_returns_each_querys_own_value() -> None:
    case = MIXED_CASES[2]
    batch = case.batch(5)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    got = reference.paged_attention(
        batch.query, batch.kv_cache, 0, *args, 0.2, sliding_window=1, soft_cap=3.0
    )
    row = 0
    group = case.group
    for seq, (context, q_len) in enumerate(zip(case.seq_lens, case.q_lens, strict=True)):
        for pos in range(context - q_len, context):
            block = batch.tables[seq][pos // case.block_size]
            own = batch.kv_cache[block, 0, 1, pos % case.block_size]  # [kv_heads, dim]
            torch.testing.assert_close(got[row], own.repeat_interleave(group, 0))
            row += 1


def test_bf16_reference_stays_within_a_rounding_of_fp32() -> None:
    case = MIXED_CASES[0]
    batch = case.batch(9, torch.bfloat16)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    got = reference.paged_attention(
        batch.query, batch.kv_cache, 1, *args, 0.2, sliding_window=15, soft_cap=2.0
    )
    assert got.dtype == torch.bfloat16
    expected = reference.paged_attention(
        batch.query.float(), batch.kv_cache.float(), 1, *args, 0.2, sliding_window=15, soft_cap=2.0
    )
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize(
    ("window", "cap", "field"),
    [
        (0, None, "sliding_window"),
        (-3, None, "sliding_window"),
        (2.0, None, "sliding_window"),
        (True, None, "sliding_window"),
        (None, 0.0, "soft_cap"),
        (None, -1.0, "soft_cap"),
        (None, float("inf"), "soft_cap"),
        (None, float("nan"), "soft_cap"),
        (None, "50", "soft_cap"),
    ],
)
def test_out_of_domain_variants_are_refused_by_name(
    window: object, cap: object, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        check_variants(window, cap)  # type: ignore[arg-type]
    batch = MIXED_CASES[3].batch(0)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    with pytest.raises(ValueError, match=field):
        reference.paged_attention(
            batch.query, batch.kv_cache, 0, *args, 0.3,
            sliding_window=window, soft_cap=cap,  # type: ignore[arg-type]
        )  # fmt: skip


@pytest.mark.parametrize("name", sorted(_BACKENDS))
def test_every_backend_implements_both_variants(name: str) -> None:
    backend = _BACKENDS[name]
    assert backend.sliding_window and backend.soft_cap
    backend.check_supports(sliding_window=True, soft_cap=True)


@pytest.mark.parametrize(("window", "cap"), [(True, False), (False, True), (True, True)])
def test_a_backend_without_a_variant_is_refused_at_load_by_name(window: bool, cap: bool) -> None:
    """What the engine's load-time check says of a backend lacking a variant (none of today's
    lacks one): the backend, each missing feature, and the way out."""
    lacking = replace(select_backend("torch"), name="x", sliding_window=False, soft_cap=False)
    lacking.check_supports(sliding_window=False, soft_cap=False)  # a model needing neither
    with pytest.raises(ValueError, match=r"'x' attention backend .*'torch' backend") as refused:
        lacking.check_supports(sliding_window=window, soft_cap=cap)
    assert ("sliding-window" in str(refused.value)) is window
    assert ("soft-capping" in str(refused.value)) is cap
