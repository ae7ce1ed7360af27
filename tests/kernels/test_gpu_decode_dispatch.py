"""On a GPU (skipped elsewhere): the decode dispatch for real. Triton's decode entry against the
CUDA kernel and the reference; a table timed on the device within its budget; a captured CUDA
graph whose plan the table gives to Triton, replayed over changing lengths; and the split step
sending its decode rows to the table's kernel (counted)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvrelay_kernels import cuda_backend, decode_dispatch, decode_timing, reference
from kvrelay_kernels.counters import COUNTERS
from kvrelay_kernels.decode_dispatch import CUDA, TRITON
from kvrelay_kernels.plan import AttentionPlan, build_plan
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def no_tables() -> Iterator[None]:
    if not cuda_backend.is_available():
        pytest.fail("the CUDA kernels did not build (see the log)")
    decode_dispatch.clear()
    yield
    decode_dispatch.clear()


def on_gpu(
    seq_lens: list[int], group: int, head_dim: int, seed: int
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch (2 KV heads), bf16 on the GPU: (batch, query, cache, tables, lens)."""
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), 16, 2, group, head_dim, seed=seed)
    dev = torch.device("cuda")
    query = batch.query.to(dev, torch.bfloat16)
    cache = batch.kv_cache.to(dev, torch.bfloat16)
    return batch, query, cache, batch.block_tables.to(dev), batch.seq_lens.to(dev)


@pytest.mark.parametrize("variant", [{}, {"sliding_window": 40}, {"soft_cap": 5.0}])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 128), (8, 128)])
def test_triton_decode_equals_the_cuda_kernel_and_the_reference(
    group: int, head_dim: int, variant: dict[str, Any]
) -> None:
    from kvrelay_kernels import triton_attention

    seed = secrets.randbelow(2**31)
    batch, query, cache, tables, lens = on_gpu([1, 17, 300, 1025], group, head_dim, seed)
    scale = head_dim**-0.5
    expected = reference.paged_attention(
        query.float().cpu(), cache.float().cpu(), 1, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, scale, **variant,
    )  # fmt: skip
    triton_out = triton_attention.decode_attention(query, cache, 1, tables, lens, scale, **variant)
    cuda_out = cuda_backend.decode_attention(query, cache, 1, tables, lens, 1025, scale, **variant)
    for got in (triton_out, cuda_out):
        torch.testing.assert_close(
            got.float().cpu(), expected, atol=3e-2, rtol=3e-2, msg=lambda m: f"{m} seed {seed}"
        )


def test_a_table_is_timed_on_the_device_within_its_budget() -> None:
    cache = torch.randn(4096, 2, 2, 16, 8, 128, device="cuda").to(torch.bfloat16)
    start = time.perf_counter()
    (table,) = decode_timing.prepare(cache, 32, environ={})
    elapsed = time.perf_counter() - start
    assert table.source == "measured", table.describe()
    assert len(table.cells) == len(decode_dispatch.BATCH_BUCKETS) * len(
        decode_dispatch.CONTEXT_BUCKETS
    ), table.describe()
    assert all(seconds > 0 for seconds in table.timings.values())
    # The budget bounds the timing; Triton's compile of its decode variant comes on top.
    assert elapsed < decode_timing.BUDGET_S + 20, elapsed
    assert decode_dispatch.installed() == [table]
    print(table.describe(), *table.grid(), sep="\n")  # for the GPU session's log


def graph_plan(tables: torch.Tensor, lens: torch.Tensor, max_len: int) -> AttentionPlan:
    """A captured decode step's plan, as graph_padding.py builds it (a fixed split-K count)."""
    n = lens.shape[0]
    return AttentionPlan(
        decode_token_idx=None, decode_block_tables=tables, decode_context=max_len, prefills=(),
        decode_lens=lens, decode_rows=(0, n), decode_seqs=(0, n), decode_partitions=1,
    )  # fmt: skip


def test_a_graph_the_table_gives_to_triton_follows_changing_lengths() -> None:
    max_len, n = 2048, 4
    batch, query, cache, tables, _ = on_gpu([max_len] * n, 4, 128, seed=1)
    lens = torch.ones(n, dtype=torch.int32, device="cuda")
    qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    shape = decode_dispatch.shape_of(cache, 8, False, False)
    decode_dispatch.install(decode_dispatch.pinned_table(shape, TRITON, {CUDA: True, TRITON: True}))
    plan = graph_plan(tables, lens, max_len)
    out = torch.empty_like(query)

    def run() -> None:
        cuda_backend.paged_attention(query, cache, 0, tables, lens, qsl, 0.1, plan=plan, out=out)

    before = COUNTERS.as_dict()
    run()  # the warm call: Triton compiles, the offsets are made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    assert COUNTERS.cuda_decode_calls == before["cuda_decode_calls"]
    assert COUNTERS.triton_decode_calls == before["triton_decode_calls"] + 2
    for new_lens in ([1, 513, 2048, 77], [2000, 2, 600, 1024]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expected = reference.paged_attention(
            query.float().cpu(), cache.float().cpu(), 0, batch.block_tables,
            torch.tensor(new_lens, dtype=torch.int32), qsl.cpu(), 0.1,
        )  # fmt: skip
        torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


def test_a_mixed_step_sends_its_decode_rows_to_the_table_s_kernel() -> None:
    seed = secrets.randbelow(2**31)
    batch = make_paged_batch([40, 30, 9], [1, 5, 1], 16, 2, 3, 64, seed=seed)
    dev = torch.device("cuda")
    query, cache = batch.query.to(dev, torch.bfloat16), batch.kv_cache.to(dev, torch.bfloat16)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, 16)
    expected = reference.paged_attention(
        query.float().cpu(), cache.float().cpu(), 1, tables, lens, qsl, 0.125, plan=plan
    )
    shape = decode_dispatch.shape_of(cache, 6, False, False)
    for kernel in (CUDA, TRITON):
        decode_dispatch.install(
            decode_dispatch.pinned_table(shape, kernel, {CUDA: True, TRITON: True})
        )
        before = COUNTERS.as_dict()
        got = cuda_backend.paged_attention(
            query, cache, 1, tables.to(dev), lens.to(dev), qsl.to(dev), 0.125, plan=plan.to(dev)
        )
        counted = {
            CUDA: COUNTERS.cuda_decode_calls - before["cuda_decode_calls"],
            TRITON: COUNTERS.triton_decode_calls - before["triton_decode_calls"],
        }
        assert counted == {CUDA: int(kernel == CUDA), TRITON: int(kernel == TRITON)}
        torch.testing.assert_close(got.float().cpu(), expected, atol=3e-2, rtol=3e-2)
