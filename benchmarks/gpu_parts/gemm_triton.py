"""A plain Triton matmul, `x @ W.T` for x `[M, K]` and W `[N, K]` (the `F.linear` layout), as
the GEMM part's (part 5) non-BLAS candidate against cuBLAS and cuBLASLt at decode-sized M.

One tile per program, fp32 accumulation, masked edges (any M, N, K), no split-K; three tile
shapes by M so that the nine M values of the benchmark cost three compilations, M itself not
specialized on. On the CPU (TRITON_INTERPRET=1, the tests) half-precision tiles are widened
to fp32 before the dot: the interpreter's bf16 dot returns garbage.

Imported only when the part measures it: importing triton reads TRITON_INTERPRET (the CPU
interpreter, which the tests use), so it must not happen earlier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(  # type: ignore[no-untyped-def]  # triton params
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + kk[None, :],
            mask=(rows[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(  # W tile read as [BLOCK_K, BLOCK_N]: W.T without a copy
            w_ptr + cols[None, :] * stride_wn + kk[:, None],
            mask=(cols[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        if UPCAST:  # the CPU interpreter's bf16 dot is wrong; its fp32 one is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def tile_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows: a 16-row tile with long
    K steps for decode batches (weight streaming), square-ish tiles above."""
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 64, 64, 4, 4
    return 128, 64, 64, 4, 3


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` (= `F.linear(x, weight)`), `[M, N]` in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    x, weight = x.contiguous(), weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m, block_n, block_k, warps, stages = tile_config(m)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _matmul_kernel[grid](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=x.device.type == "cpu" and x.dtype != torch.float32,
        num_warps=warps,
        num_stages=stages,
    )
    return out
