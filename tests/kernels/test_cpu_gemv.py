"""kvrelay's AVX2 single-row matmul against torch, across awkward shapes."""

from __future__ import annotations

import pytest
import torch

from kvrelay_kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="needs AVX2 and a compiler")


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 9), (8, 8), (300, 577), (960, 576), (4097, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_torch(n: int, k: int, bias: bool) -> None:
    x = torch.randn(1, k)
    weight = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    expected = torch.nn.functional.linear(x, weight, b)
    torch.testing.assert_close(cpu_gemv.gemv(x, weight, b), expected, atol=1e-4, rtol=1e-5)


def test_gemv_rejects_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match=r"shape \[1, K\]"):
        cpu_gemv.gemv(torch.randn(2, 4), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_gemv.gemv(
            torch.randn(1, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
        )
    with pytest.raises(RuntimeError, match="weight is"):
        cpu_gemv.gemv(torch.randn(1, 4), torch.randn(3, 5))
