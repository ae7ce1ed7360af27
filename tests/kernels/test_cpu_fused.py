"""The fused CPU layer ops (kvrelay_kernels.cpu_fused) against the torch code they replace:
RoPE bit for bit, norms up to the order of one fp32 sum, the residual updated in place."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.layers import RMSNorm
from kvrelay.models.rope import RotaryEmbedding, apply_rope, apply_rope_with_torch_ops
from kvrelay_kernels.cpu_fused import fused_ops_for, load_fused_ops

pytestmark = pytest.mark.skipif(
    load_fused_ops() is None, reason="the fused CPU ops do not build here"
)
DTYPES = [torch.float32, torch.bfloat16]


def assert_norm_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # one bf16 rounding apart at most, and rarely
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0)
        assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rope_is_torchs_bit_for_bit(dtype: torch.dtype, tokens: int) -> None:
    torch.manual_seed(tokens)
    rotary = RotaryEmbedding(64, 10000.0, None, 512)
    positions = torch.randint(0, 512, (tokens,))
    cos, sin = rotary.cos_sin(positions, dtype)
    # q and k as the attention takes them: a strided view of the fused qkv projection.
    qkv = (torch.randn(tokens, (9 + 3 + 3) * 64) * 4).to(dtype)
    qk = qkv[:, : 12 * 64].view(tokens, 12, 64)
    assert tokens == 1 or not qk.is_contiguous()
    got = apply_rope(qk, cos, sin)
    assert torch.equal(got, apply_rope_with_torch_ops(qk, cos, sin))
    assert got.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_rms_norm_matches_the_torch_path(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data.copy_(torch.randn(576) * 0.3 + 1)
    wide = (torch.randn(rows, 2 * 576) * 3).to(dtype)
    x = wide[:, 100 : 100 + 576]  # rows apart in memory: the op takes strided rows
    assert_norm_close(norm.forward(x), norm.forward_with_torch_ops(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_and_norm_updates_the_residual_in_place(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(576, 1e-6).to(dtype)
    norm.weight.data.copy_(torch.randn(576) * 0.3 + 1)
    residual = (torch.randn(4, 576) * 2).to(dtype)
    delta = (torch.randn(4, 576) * 2).to(dtype)
    expected_sum = residual + delta  # torch's rounding of the add
    before = residual.data_ptr()
    out = norm.add_and_norm(residual, delta)
    assert residual.data_ptr() == before and torch.equal(residual, expected_sum)
    assert_norm_close(out, norm.forward_with_torch_ops(expected_sum))


def test_other_devices_and_dtypes_take_the_torch_path() -> None:
    assert fused_ops_for(torch.empty(2, 8, device="meta")) is None
    assert fused_ops_for(torch.empty(2, 8, dtype=torch.float16)) is None
    norm = RMSNorm(8, 1e-5).to("meta")
    out = norm.forward(torch.empty(3, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 8)
    half = RMSNorm(8, 1e-5).half()
    x = torch.randn(2, 8).half()
    torch.testing.assert_close(half.forward(x), half.forward_with_torch_ops(x))


def test_the_ops_refuse_what_they_cannot_read() -> None:
    ops = load_fused_ops()
    assert ops is not None
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="head_dim contiguous and even"):
        ops.rope(torch.randn(2, 3, 7), torch.randn(2, 1, 3), torch.randn(2, 1, 3))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.rope(
            torch.randn(2, 3, 8).half(), torch.randn(2, 1, 4).half(), torch.randn(2, 1, 4).half()
        )
