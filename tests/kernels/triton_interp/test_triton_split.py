"""The Triton varlen kernel as the prefill half of a mixed step (interpreted on the CPU):
given a slice of the step's query offsets (not starting at 0) it must read and write only
those rows, and given gathered rows (interleaved decodes) the re-based offsets."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import build_plan, reference
from kvrelay_kernels.split import split_attention
from kvrelay_kernels.triton_attention import paged_attention as triton_attention
from tests.kernels.paged_batch import make_paged_batch
from tests.kernels.split_cases import MIXED_CASES, Recorder


@pytest.mark.parametrize(("seq_lens", "q_lens"), MIXED_CASES)
def test_triton_prefill_half_of_a_split_step(seq_lens: list[int], q_lens: list[int]) -> None:
    block_size, scale = 16, 0.125
    batch = make_paged_batch(seq_lens, q_lens, block_size, 2, 3, 64, num_layers=2, seed=7)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, block_size)
    expected = reference.paged_attention(batch.query, batch.kv_cache, 1, tables, lens, qsl, scale)
    decode = Recorder(batch.kv_cache, 1, scale).decode
    calls: list[int] = []

    def prefill(
        q: torch.Tensor,
        t: torch.Tensor,
        sl: torch.Tensor,
        offsets: torch.Tensor,
        into: torch.Tensor | None,
    ) -> torch.Tensor:
        calls.append(int(sl.shape[0]))
        return triton_attention(q, batch.kv_cache, 1, t, sl, offsets, scale, out=into)

    out = torch.full_like(batch.query, float("nan"))
    split_attention(batch.query, tables, lens, qsl, plan, out, decode, prefill)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert calls == ([sum(n > 1 for n in q_lens)] if any(n > 1 for n in q_lens) else [])
