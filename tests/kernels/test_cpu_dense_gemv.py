"""csrc_cpu/dense_gemv.cpp: few-row dense matmuls that stream a row-major weight, against the
fp32 matmul, and `dense_gemv_for`'s choice of where the kernel takes a weight."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvrelay_kernels.cpu_dense import GEMV_MAX_ROWS, dense_gemv_for, load_dense_gemv_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ops_for(name: str) -> ModuleType:
    ops = load_dense_gemv_ops()
    assert ops is not None, "the CPU kernels did not build (is a C++ compiler there?)"
    if not ops.supports(name):
        pytest.skip(f"this build has no few-row kernel for {name} (no AVX-512 / AVX512-BF16)")
    return ops


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("n", [1, 7, 64, 1538])  # tails of the four weight rows read together
@pytest.mark.parametrize("steps", [1, 2, 3, 18])  # in-features in the kernel's steps (odd: a tail)
def test_the_kernel_matches_the_fp64_matmul(name: str, rows: int, n: int, steps: int) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    k = steps * ops.k_multiple(name)
    gen = torch.Generator().manual_seed(rows * 1000 + n + steps)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        got = ops.dense_gemv(x, w, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        expected = reference(x, w, b)
        # fp32 sums in another order (about sqrt(k) roundings of 2^-24 of the sum's terms),
        # then one rounding to the output's dtype.
        scale = k**0.5
        rounding = 2**-8 if dtype == torch.bfloat16 else 2**-20
        torch.testing.assert_close(got.double(), expected, rtol=rounding, atol=1e-5 * scale)


@pytest.mark.parametrize("name", DTYPES)
def test_a_strided_input_is_read_as_its_values(name: str) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    k = 4 * ops.k_multiple(name)
    x = torch.randn(k, 3).to(dtype).t()  # [3, k], not contiguous
    w = torch.randn(10, k).to(dtype)
    assert torch.equal(ops.dense_gemv(x, w, None), ops.dense_gemv(x.contiguous(), w, None))


@pytest.mark.parametrize("name", DTYPES)
def test_bad_shapes_are_refused(name: str) -> None:
    ops, dtype = ops_for(name), DTYPES[name]
    k = ops.k_multiple(name)
    with pytest.raises(RuntimeError, match="multiple of"):
        ops.dense_gemv(torch.randn(1, k + 2).to(dtype), torch.randn(4, k + 2).to(dtype), None)
    with pytest.raises(RuntimeError, match="contiguous w"):
        ops.dense_gemv(torch.randn(1, k).to(dtype), torch.randn(k, 4).to(dtype).t(), None)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.dense_gemv(torch.randn(1, k).to(dtype), torch.randn(4, k).half(), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.dense_gemv(torch.randn(1, k).to(dtype), torch.randn(4, k).to(dtype), torch.ones(3))


def test_dense_gemv_for_takes_only_what_the_kernel_runs() -> None:
    ops = load_dense_gemv_ops()
    assert ops is not None
    fp32 = torch.randn(8, 64)
    assert (dense_gemv_for(fp32) is not None) == ops.supports("float32")
    assert (dense_gemv_for(fp32.bfloat16()) is not None) == ops.supports("bfloat16")
    assert dense_gemv_for(fp32.half()) is None  # no fp16 kernel
    assert dense_gemv_for(torch.randn(8, 40)) is None  # in-features not in whole steps
    assert dense_gemv_for(torch.randn(8, 64, device="meta")) is None
    assert dense_gemv_for(torch.randn(2, 8, 64)) is None
    assert set(GEMV_MAX_ROWS) == {torch.float32, torch.bfloat16}
