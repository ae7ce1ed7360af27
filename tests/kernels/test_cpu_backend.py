"""kvrelay's C++ CPU decode attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import build_plan, cpu_backend, reference, select_backend
from tests.kernels.paged_batch import make_paged_batch

pytestmark = pytest.mark.skipif(
    not cpu_backend.is_available(), reason="the CPU kernel does not build here"
)


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
    batch = make_paged_batch(
        seq_lens, q_lens, block_size, kv_heads, group, dim, num_layers=3, seed=sum(seq_lens)
    )
    query, kv_cache, tables = batch.query, batch.kv_cache, batch.block_tables
    lens, qsl = batch.seq_lens, batch.query_start_loc
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
