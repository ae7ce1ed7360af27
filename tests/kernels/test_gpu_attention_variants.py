"""Sliding windows and soft caps on a GPU: the CUDA decode kernel (split-K and not), the `cuda`
backend's split steps (decodes by CUDA, prefill chunks by Triton) and Triton alone, against
the torch reference in fp32 on the CPU. Skipped without CUDA (`pytest tests/kernels -k gpu`).

Outputs are poisoned with NaN before each call, and keys before every query's window are NaN
too, so a kernel reading one fails; inputs are fresh random each run (the seed is in the
message).
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import pytest
import torch

from kvrelay_kernels import cuda_backend, reference, triton_backend
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (window, cap): Mistral's / Gemma 3's windows alone, Gemma 2's window with a cap, a cap
# alone, a window of 1, windows inside one split-K partition (512) and across several.
VARIANTS = [(1, None), (7, None), (100, None), (600, 50.0), (None, 5.0), (1100, 0.5), (4096, None)]


def _poisoned(batch: PagedBatch, q_lens: list[int], window: int | None) -> torch.Tensor:
    """The cache with NaN at every position no query of its sequence sees (before its first
    query's window), in every layer."""
    cache = batch.kv_cache.clone()
    if window is None:
        return cache
    block_size = cache.shape[3]
    for table, context, q_len in zip(batch.tables, batch.seq_lens.tolist(), q_lens, strict=True):
        for pos in range(max(0, context - q_len + 1 - window)):
            cache[table[pos // block_size], :, :, pos % block_size] = float("nan")
    return cache


def _expected(
    batch: PagedBatch, dtype: torch.dtype, layer: int, scale: float, variant: dict[str, object]
) -> torch.Tensor:
    """The reference in fp32 on the CPU, on the same dtype-rounded inputs (and clean cache)."""
    return reference.paged_attention(
        batch.query.to(dtype).float(), batch.kv_cache.to(dtype).float(), layer,
        batch.block_tables, batch.seq_lens, batch.query_start_loc, scale,
        **variant,  # type: ignore[arg-type]
    )  # fmt: skip


def _variant(window: int | None, cap: float | None) -> dict[str, object]:
    return {"sliding_window": window, "soft_cap": cap}


def _check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    torch.cuda.synchronize()
    assert not got.isnan().any(), f"a NaN: a row unwritten or a key read outside (seed {seed})"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        got.float().cpu(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{m} seed {seed}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("window", "cap"), VARIANTS)
def test_cuda_decode_variants_match_the_reference(
    window: int | None, cap: float | None, head_dim: int, dtype: torch.dtype
) -> None:
    if not cuda_backend.is_available():
        pytest.fail("the CUDA kernels did not build (see the log)")
    seed = secrets.randbelow(2**31)
    seq_lens = [1, 19, 700, 1537, 47]  # partial last blocks; 1,500+ tokens split
    batch = make_paged_batch(seq_lens, [1] * 5, 16, 2, 3, head_dim, num_layers=2, seed=seed)
    batch = replace(batch, query=batch.query * 3)  # scores of a few units: the caps bend them
    dev = torch.device("cuda")
    query = batch.query.to(dev, dtype)
    cache = _poisoned(batch, [1] * 5, window).to(dev, dtype)
    tables, lens = batch.block_tables.to(dev), batch.seq_lens.to(dev)
    expected = _expected(batch, dtype, 1, head_dim**-0.5, _variant(window, cap))
    parts = cuda_backend.max_partitions(100_000)
    workspace = torch.empty(
        cuda_backend.split_workspace_numel(5, query.shape[1], head_dim, parts),
        dtype=torch.float32, device=dev,
    )  # fmt: skip
    # The kernel's own split-K choice, split-K for every sequence, a CUDA graph's fixed
    # partition count with its preallocated workspace, and one partition (unsplit) whatever
    # the window.
    configs = ((1537, 0, None), (100_000, 0, None), (1537, parts, workspace), (1537, 1, None))
    for max_len, fixed, scratch in configs:
        out = torch.full_like(query, float("nan"))
        cuda_backend.decode_attention(
            query, cache, 1, tables, lens, max_len, head_dim**-0.5, out=out,
            num_partitions=fixed, workspace=scratch, sliding_window=window, soft_cap=cap,
        )  # fmt: skip
        _check(out, expected, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("window", "cap"), VARIANTS)
def test_cuda_backend_split_steps_carry_the_variants(
    window: int | None, cap: float | None, dtype: torch.dtype
) -> None:
    """Decode rows by the CUDA kernel, prefill chunks by Triton, in one step; decodes before
    prompts (contiguous spans) and interleaved (gathered rows)."""
    if not cuda_backend.is_available():
        pytest.fail("the CUDA kernels did not build (see the log)")
    seed = secrets.randbelow(2**31)
    for seq_lens, q_lens in (([40, 900, 1300, 64], [1, 1, 300, 64]), ([700, 90, 33], [1, 40, 1])):
        batch = make_paged_batch(seq_lens, q_lens, 16, 2, 4, 128, seed=seed)
        dev = torch.device("cuda")
        query = batch.query.to(dev, dtype)
        cache = _poisoned(batch, q_lens, window).to(dev, dtype)
        args = (batch.block_tables.to(dev), batch.seq_lens.to(dev), batch.query_start_loc.to(dev))
        out = torch.full_like(query, float("nan"))
        # No plan: the backend builds one on the device (plan_on_device), as the GPU check does.
        got = cuda_backend.paged_attention(
            query, cache, 0, *args, 0.1, out=out, sliding_window=window, soft_cap=cap
        )
        _check(got, _expected(batch, dtype, 0, 0.1, _variant(window, cap)), dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "cap"), VARIANTS)
def test_triton_on_gpu_variants_match_the_reference(
    window: int | None, cap: float | None, dtype: torch.dtype
) -> None:
    if not triton_backend.is_available():
        pytest.skip("triton is not installed")
    from kvrelay_kernels import triton_attention

    seed = secrets.randbelow(2**31)
    q_lens = [1, 20, 1, 300]
    batch = make_paged_batch([1, 45, 300, 1100], q_lens, 16, 2, 3, 64, seed=seed)
    dev = torch.device("cuda")
    query = batch.query.to(dev, dtype)
    cache = _poisoned(batch, q_lens, window).to(dev, dtype)
    args = (batch.block_tables.to(dev), batch.seq_lens.to(dev), batch.query_start_loc.to(dev))
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(
        query, cache, 1, *args, 0.1, out=out, sliding_window=window, soft_cap=cap
    )
    _check(out, _expected(batch, dtype, 1, 0.1, _variant(window, cap)), dtype, seed)
