"""kvrelay's C++ CPU prefill attention (cpu_prefill.py) against the torch reference: prompts and
chunks after a computed prefix, several chunks beside decodes, the kernel's tile edges (16
query vectors, 16-key score tiles, 64-key softmax blocks), GQA groups under and over its tile,
head dims that are not whole vectors, sliding windows and soft caps."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import build_plan, cpu_backend, cpu_prefill, reference
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

pytestmark = pytest.mark.skipif(
    cpu_prefill.load_extension() is None, reason="the CPU prefill kernel does not build here"
)
QUERY_GAIN = 3.0  # scores of a few units, so that the softmax is not flat and caps bend them


def _run_both(
    batch: PagedBatch,
    dtype: torch.dtype,
    window: int | None = None,
    cap: float | None = None,
    layer: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, fp32 reference over the same inputs) for the batch's prefill chunks; the rows
    of decodes are left as the NaN-filled `out` had them."""
    query = (batch.query * QUERY_GAIN).to(dtype)
    kv_cache = batch.kv_cache.to(dtype)
    plan = build_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, kv_cache.shape[3])
    scale = query.shape[-1] ** -0.5
    got = torch.full_like(query, float("nan"))
    cpu_prefill.prefill_attention(query, kv_cache, layer, plan, scale, got, window, cap)
    expected = torch.full_like(query, float("nan"), dtype=torch.float32)
    reference.prefill_attention(
        query.float(), kv_cache.float(), layer, plan, scale, expected, window, cap
    )
    return got, expected


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    else:  # widened to fp32 inside, rounded once at the end: within one bf16 rounding
        torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7, equal_nan=True)


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([1], [1]),  # a decode only: nothing for this kernel, its row left untouched
        ([2], [2]),
        ([63], [63]),  # just under a softmax block
        ([64], [64]),
        ([65], [65]),  # one key into the second block
        ([130], [130]),  # three blocks, the last partial
        ([200], [37]),  # a chunk after 163 computed tokens: its rows see the whole prefix
        ([70, 1, 45, 1], [70, 1, 13, 1]),  # chunks beside decodes, rows not contiguous
    ],
)
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "dim"),
    # blocks under and at the score tile; groups that fill 16 query slots unevenly (3: 15),
    # exactly (4, 8), and over them (20: two head tiles of one row); head dims under a
    # vector, with a tail, and whole
    [(4, 2, 3, 8), (16, 3, 3, 64), (16, 1, 20, 24), (32, 2, 4, 80), (16, 2, 8, 16), (16, 4, 1, 32)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_the_reference(
    seq_lens: list[int],
    q_lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    dim: int,
    dtype: torch.dtype,
) -> None:
    batch = make_paged_batch(
        seq_lens, q_lens, block_size, kv_heads, group, dim, num_layers=3, seed=sum(seq_lens)
    )
    got, expected = _run_both(batch, dtype)
    _assert_close(got, expected, dtype)
    decode_rows = torch.isnan(expected[:, 0, 0])
    assert torch.isnan(got[decode_rows].float()).all()  # rows it does not own stay untouched


@pytest.mark.parametrize("window", [1, 5, 16, 64, 100, 500])
@pytest.mark.parametrize("cap", [None, 4.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_caps_match_the_reference(
    window: int, cap: float | None, dtype: torch.dtype
) -> None:
    """Windows narrower than a row's prefix: whole 64-key blocks before a row's window are
    skipped or masked, and a row whose window starts inside a block sees only its part."""
    batch = make_paged_batch([180, 90], [180, 30], 16, 2, 3, 64, num_layers=2, seed=window)
    got, expected = _run_both(batch, dtype, window, cap)
    _assert_close(got, expected, dtype)


@pytest.mark.parametrize("cap", [0.5, 30.0])
def test_soft_cap_alone_matches_the_reference(cap: float) -> None:
    batch = make_paged_batch([150], [150], 16, 2, 4, 64, num_layers=2, seed=7)
    got, expected = _run_both(batch, torch.float32, cap=cap)
    _assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_any_thread_count_gives_the_same_output(threads: int) -> None:
    """Tiles go to threads in contiguous zigzag ranges, each thread transposing the keys of
    every (chunk, KV head) it meets: the split must not change a value."""
    batch = make_paged_batch([150, 40], [150, 40], 16, 3, 3, 64, num_layers=2, seed=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, expected = _run_both(batch, torch.float32)
    finally:
        torch.set_num_threads(before)
    _assert_close(got, expected, torch.float32)


def test_queries_viewed_in_a_fused_projection_are_read_in_place() -> None:
    """Rows with a stride (queries sliced out of a fused QKV output) give what a contiguous
    copy gives."""
    batch = make_paged_batch([50], [50], 16, 2, 3, 32, num_layers=1, seed=3)
    query = batch.query
    fused = torch.cat([query.flatten(1), torch.randn(50, 40)], dim=1)
    strided = fused[:, : query[0].numel()].view_as(query)
    assert not strided.is_contiguous()
    plan = build_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    got, expected = torch.empty_like(query), torch.empty_like(query)
    cpu_prefill.prefill_attention(strided, batch.kv_cache, 0, plan, 0.2, got)
    cpu_prefill.prefill_attention(query, batch.kv_cache, 0, plan, 0.2, expected)
    assert torch.equal(got, expected)


def test_a_block_outside_the_cache_is_refused_and_out_is_untouched() -> None:
    batch = make_paged_batch([40], [40], 16, 1, 2, 16, num_layers=1, seed=1)
    module = cpu_prefill.load_extension()
    assert module is not None
    chunks = torch.tensor([[0, 40, 40]])
    tables = torch.tensor([[0, 1, batch.kv_cache.shape[0]]])  # the third block is past the end
    out = torch.zeros_like(batch.query)
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.paged_prefill_attention(
            batch.query, batch.kv_cache, 0, chunks, tables, 0.25, 0, 0.0, out
        )
    assert not out.any()
    with pytest.raises(RuntimeError, match="does not fit"):
        module.paged_prefill_attention(
            batch.query, batch.kv_cache, 0, torch.tensor([[0, 41, 40]]), tables, 0.25, 0, 0.0, out
        )


def test_without_the_kernel_the_reference_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (the build fails): the reference computes the same chunks."""
    batch = make_paged_batch([90, 1], [90, 1], 16, 2, 3, 64, num_layers=2, seed=5)
    with_kernel, _ = _run_both(batch, torch.float32)
    monkeypatch.setattr(cpu_prefill, "load_extension", lambda: None)
    without, expected = _run_both(batch, torch.float32)
    torch.testing.assert_close(without, expected, equal_nan=True)
    torch.testing.assert_close(with_kernel, without, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_the_cpu_backend_runs_prompt_steps_in_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of prompts only, and a mixed step, reach the kernel through the backend (the
    reference's gather is never called)."""
    calls: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append("reference")

    monkeypatch.setattr(reference, "prefill_attention", refuse)
    for seq_lens, q_lens in (([70, 20], [70, 20]), ([70, 9], [70, 1])):
        batch = make_paged_batch(seq_lens, q_lens, 16, 2, 3, 64, num_layers=1, seed=2)
        query, kv_cache = batch.query.bfloat16(), batch.kv_cache.bfloat16()
        args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
        got = cpu_backend.paged_attention(query, kv_cache, 0, *args, 0.125)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
    assert calls == []
