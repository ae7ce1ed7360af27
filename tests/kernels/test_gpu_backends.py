"""The CUDA and Triton backends on a GPU against the torch reference (run on the CPU in fp32).

Skipped without CUDA (on a GPU with pytest: `pytest tests/kernels tests/engine -k gpu`;
`benchmarks/gpu_check.py` checks the same kernels with no pytest). Outputs are poisoned
with NaN before each call; inputs are fresh random each run (the seed is in the message).
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from kvrelay_kernels import build_plan, cuda_backend, reference, triton_backend
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


def _needs_cuda_kernels() -> None:
    if not cuda_backend.is_available():
        pytest.fail("the CUDA kernels did not build (see the log)")


def _expected(batch: PagedBatch, dtype: torch.dtype, layer: int, scale: float) -> torch.Tensor:
    """The reference in fp32 on the CPU, on the same dtype-rounded inputs."""
    return reference.paged_attention(
        batch.query.to(dtype).float(),
        batch.kv_cache.to(dtype).float(),
        layer,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
    )


def _on_gpu(batch: PagedBatch, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    dev = torch.device("cuda")
    return (
        batch.query.to(dev, dtype),
        batch.kv_cache.to(dev, dtype),
        batch.block_tables.to(dev),
        batch.seq_lens.to(dev),
        batch.query_start_loc.to(dev),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8, 12])
def test_cuda_decode_matches_the_reference(
    group: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> None:
    _needs_cuda_kernels()
    seed = secrets.randbelow(2**31)
    # Unequal contexts with partial last blocks; 1,500+ tokens take the split-K path.
    seq_lens = [1, block_size + 3, 700, 1537, 3 * block_size - 1]
    batch = make_paged_batch(
        seq_lens, [1] * len(seq_lens), block_size, 2, group, head_dim, num_layers=2, seed=seed
    )
    query, kv_cache, tables, lens, _ = _on_gpu(batch, dtype)
    scale = head_dim**-0.5
    expected = _expected(batch, dtype, 1, scale)
    for max_len in (max(seq_lens), 100_000):  # the second forces split-K for every sequence
        out = torch.full_like(query, float("nan"))
        cuda_backend.decode_attention(query, kv_cache, 1, tables, lens, max_len, scale, out=out)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"rows left unwritten (seed {seed})"
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(
            out.float().cpu(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{m} seed {seed}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_cuda_backend_mixed_batch_and_strided_query(dtype: torch.dtype) -> None:
    _needs_cuda_kernels()
    seed = secrets.randbelow(2**31)
    batch = make_paged_batch([40, 300, 17, 64], [1, 30, 17, 1], 16, 3, 3, 64, seed=seed)
    query, kv_cache, tables, lens, qsl = _on_gpu(batch, dtype)
    expected = _expected(batch, dtype, 0, 0.125)
    fused = torch.randn(query.shape[0], 12, 64, device="cuda", dtype=dtype)
    fused[:, :9] = query
    out = torch.full_like(query, float("nan"))
    got = cuda_backend.paged_attention(fused[:, :9], kv_cache, 0, tables, lens, qsl, 0.125, out=out)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=rtol)
    # An all-decode step through the backend entry point (the engine's path).
    decode = make_paged_batch([33, 900, 5], [1, 1, 1], 32, 2, 4, 128, seed=seed)
    q, kv, t, sl, ql = _on_gpu(decode, dtype)
    plan = build_plan(t, sl, ql, 32)
    got = cuda_backend.paged_attention(q, kv, 1, t, sl, ql, 0.1, plan=plan)
    torch.testing.assert_close(
        got.float().cpu(), _expected(decode, dtype, 1, 0.1), atol=atol, rtol=rtol
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_cuda_write_kv_and_copy_blocks(dtype: torch.dtype) -> None:
    _needs_cuda_kernels()
    gen = torch.Generator().manual_seed(secrets.randbelow(2**31))
    shape = (8, 3, 2, 16, 2, 80)
    cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(8 * 16, generator=gen)[:11]
    slots[3] = -1
    kv = torch.randn(11, 4, 80, generator=gen).to(dtype)
    expected = cache.clone()
    reference.write_kv(kv[:, :2], kv[:, 2:], expected, 2, slots)
    got = cache.cuda()
    cuda_backend.write_kv(kv[:, :2].cuda(), kv[:, 2:].cuda(), got, 2, slots.cuda())
    torch.testing.assert_close(got.cpu(), expected, atol=0, rtol=0)
    src, dst = torch.tensor([0, 5, 2]), torch.tensor([7, 1, 4])
    reference.copy_blocks(expected, src, dst)
    cuda_backend.copy_blocks(got, src.cuda(), dst.cuda())
    torch.testing.assert_close(got.cpu(), expected, atol=0, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter session")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 128), (8, 128)])
def test_triton_on_gpu_matches_the_reference(group: int, head_dim: int, dtype: torch.dtype) -> None:
    if not triton_backend.is_available():
        pytest.skip("triton is not installed")
    from kvrelay_kernels import triton_attention

    seed = secrets.randbelow(2**31)
    batch = make_paged_batch([1, 45, 300, 1100], [1, 20, 1, 300], 16, 2, group, head_dim, seed=seed)
    query, kv_cache, tables, lens, qsl = _on_gpu(batch, dtype)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, kv_cache, 1, tables, lens, qsl, 0.1, out=out)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float().cpu(), _expected(batch, dtype, 1, 0.1), atol=atol, rtol=rtol,
        msg=lambda m: f"{m} seed {seed}",
    )  # fmt: skip
