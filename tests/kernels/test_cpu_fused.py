"""The fused CPU layer ops (kvrelay_kernels.cpu_fused) against the torch code they replace:
RoPE and SiLU-and-multiply bit for bit, norms up to the order of one fp32 sum, the residual
updated in place."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.layers import GatedMLP, RMSNorm
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
# 16 fp32 lanes at a time: 64 and 128 in whole vectors, 40 and 12 with values left one by one
@pytest.mark.parametrize("head_dim", [64, 128, 40, 12])
def test_rope_is_torchs_bit_for_bit(dtype: torch.dtype, tokens: int, head_dim: int) -> None:
    torch.manual_seed(tokens)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, 512)
    positions = torch.randint(0, 512, (tokens,))
    cos, sin = rotary.cos_sin(positions, dtype)
    # q and k as the attention takes them: a strided view of the fused qkv projection.
    qkv = (torch.randn(tokens, (9 + 3 + 3) * head_dim) * 4).to(dtype)
    qk = qkv[:, : 12 * head_dim].view(tokens, 12, head_dim)
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
    with pytest.raises(RuntimeError, match=r"\[rows, 2 \* n\]"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match=r"\[rows, 2 \* n\]"):
        ops.silu_and_mul(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.silu_and_mul(torch.randn(2, 8).half())


SILU_SHAPES = [(1, 1536), (16, 1536), (40, 37), (3, 5), (2, 100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "intermediate"), SILU_SHAPES)
def test_silu_and_mul_is_torchs_bit_for_bit(
    dtype: torch.dtype, rows: int, intermediate: int
) -> None:
    # 37, 5 and 100 leave tails after the vector loop (torch's scalar exp there); 40 rows
    # split over threads.
    torch.manual_seed(rows + intermediate)
    mlp = GatedMLP(8, intermediate)
    gate_up = (torch.randn(rows, 2 * intermediate) * 4).to(dtype)
    got = fused_silu_and_mul(gate_up)
    assert got.shape == (rows, intermediate) and got.is_contiguous()
    assert torch.equal(got, mlp.silu_and_mul_with_torch_ops(gate_up.clone()))


def test_silu_and_mul_of_every_bf16_gate_is_torchs() -> None:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gates = bits.view(torch.bfloat16)
    gates = gates[torch.isfinite(gates)]
    gates = gates[: gates.numel() // 64 * 64].view(-1, 64)  # every finite bf16 value
    up = (torch.randn(gates.shape) * 3).to(torch.bfloat16)
    gate_up = torch.cat((gates, up), dim=1)
    expected = GatedMLP(8, 64).silu_and_mul_with_torch_ops(gate_up)
    assert torch.equal(fused_silu_and_mul(gate_up).view(torch.int16), expected.view(torch.int16))


def test_silu_and_mul_reads_strided_rows() -> None:
    wide = torch.randn(6, 3 * 16)
    gate_up = wide[:, 8 : 8 + 32]  # rows 48 apart in memory
    expected = GatedMLP(8, 16).silu_and_mul_with_torch_ops(gate_up)
    assert torch.equal(fused_silu_and_mul(gate_up), expected)


def test_the_mlp_takes_the_fused_op_on_the_cpu_and_torch_ops_elsewhere() -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48)
    x = torch.randn(5, 32)
    gate_up = mlp.gate_up_proj.forward(x)
    expected = mlp.down_proj.forward(mlp.silu_and_mul_with_torch_ops(gate_up))
    assert torch.equal(mlp.forward(x), expected)
    meta = GatedMLP(32, 48).to("meta")
    assert meta.forward(torch.empty(5, 32, device="meta")).shape == (5, 32)


def fused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = load_fused_ops()
    assert ops is not None
    out: torch.Tensor = ops.silu_and_mul(gate_up)
    return out
