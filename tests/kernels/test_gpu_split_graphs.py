"""On a GPU (skipped elsewhere): mixed steps split between the CUDA decode kernel and the
Triton prefill kernel, the fixed split-K count and workspace inside a captured CUDA graph,
and `write_kv`'s padding and out-of-cache slots."""

from __future__ import annotations

import secrets

import pytest
import torch

from kvrelay_kernels import build_plan, cuda_backend, reference, triton_backend
from kvrelay_kernels.counters import COUNTERS
from tests.kernels.paged_batch import make_paged_batch
from tests.kernels.split_cases import MIXED_CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _kernels() -> None:
    if not cuda_backend.is_available():
        pytest.fail("the CUDA kernels did not build (see the log)")


@pytest.mark.parametrize(("seq_lens", "q_lens"), MIXED_CASES)
def test_mixed_steps_run_both_kernels_once(seq_lens: list[int], q_lens: list[int]) -> None:
    _kernels()
    seed = secrets.randbelow(2**31)
    batch = make_paged_batch(seq_lens, q_lens, 16, 2, 3, 64, seed=seed)
    dev = torch.device("cuda")
    query, cache = batch.query.to(dev, torch.bfloat16), batch.kv_cache.to(dev, torch.bfloat16)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, 16)
    expected = reference.paged_attention(
        query.float().cpu(), cache.float().cpu(), 1, tables, lens, qsl, 0.125, plan=plan
    )
    before = COUNTERS.as_dict()
    got = cuda_backend.paged_attention(
        query, cache, 1, tables.to(dev), lens.to(dev), qsl.to(dev), 0.125, plan=plan.to(dev)
    )
    torch.testing.assert_close(got.float().cpu(), expected, atol=3e-2, rtol=3e-2)
    decodes, prefills = 1 in q_lens, any(n > 1 for n in q_lens)
    assert COUNTERS.cuda_decode_calls - before["cuda_decode_calls"] == int(decodes)
    if triton_backend.is_available():
        assert COUNTERS.triton_prefill_calls - before["triton_prefill_calls"] == int(prefills)


def test_fixed_partitions_in_a_graph_follow_changing_lengths() -> None:
    """A decode captured once with the fixed split-K count and a preallocated workspace,
    replayed over different context lengths, equals the reference each time."""
    _kernels()
    dev = torch.device("cuda")
    max_len, num_seqs, block_size = 4096, 4, 16
    batch = make_paged_batch([max_len] * num_seqs, [1] * num_seqs, block_size, 2, 4, 128)
    query = batch.query.to(dev, torch.bfloat16)
    cache = batch.kv_cache.to(dev, torch.bfloat16)
    tables = batch.block_tables.to(dev)
    lens = torch.ones(num_seqs, dtype=torch.int32, device=dev)
    parts = cuda_backend.graph_partitions(max_len, num_seqs, 2, 4, dev)
    numel = cuda_backend.split_workspace_numel(num_seqs, 8, 128, parts)
    workspace = torch.empty(numel, dtype=torch.float32, device=dev)
    out = torch.empty_like(query)

    def run() -> None:
        cuda_backend.decode_attention(
            query, cache, 0, tables, lens, max_len, 0.1, out=out,
            num_partitions=parts, workspace=workspace,
        )  # fmt: skip

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for new_lens in ([1, 513, 4096, 77], [4000, 2, 600, 1024]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        cpu_lens = torch.tensor(new_lens, dtype=torch.int32)
        expected = reference.paged_attention(
            query.float().cpu(), cache.float().cpu(), 0, batch.block_tables, cpu_lens,
            torch.arange(num_seqs + 1, dtype=torch.int32), 0.1,
        )  # fmt: skip
        torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


def test_write_kv_skips_padding_and_slots_past_the_cache() -> None:
    _kernels()
    module = cuda_backend.load_extension()
    assert module is not None
    cache = torch.randn(4, 2, 2, 16, 2, 64, device="cuda", dtype=torch.float16)
    before = cache.clone()
    key = torch.randn(3, 2, 64, device="cuda", dtype=torch.float16)
    slots = torch.tensor([-1, 4 * 16, 4 * 16 + 5], device="cuda")  # padding, past the end
    module.write_kv(key, key, cache, 1, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, before)
