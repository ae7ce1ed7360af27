"""The CPU block kernel (csrc_cpu/block_quant_matmul.cpp) against gguf's own dequantization:
both formats' dense weights and matmuls at every tile shape, bf16 rounding, refusals, and the
AVX2 and plain x86-64 builds of the same source."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.gguf_blocks import (
    GgufBlocks,
)
from kvrelay_kernels.cpu_extension import CSRC_CPU
from kvrelay_kernels.cpu_quantized import load_block_quant_ops
from tests.kernels.gguf_weights import FORMATS, gguf_weight


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    module = load_block_quant_ops()
    assert module is not None, "the CPU block kernel did not build (is a C++ compiler there?)"
    return module


def _matmul(
    ops: ModuleType, blocks: GgufBlocks, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out: torch.Tensor
    if blocks.m is not None:
        out = ops.q4_1_matmul(x, blocks.codes, blocks.d, blocks.m, bias)
    else:
        out = ops.q8_0_matmul(x, blocks.codes, blocks.d, bias)
    return out


def _dequantize(ops: ModuleType, blocks: GgufBlocks, dtype: torch.dtype) -> torch.Tensor:
    out: torch.Tensor
    if blocks.m is not None:
        out = ops.q4_1_dequantize(blocks.codes, blocks.d, blocks.m, dtype)
    else:
        out = ops.q8_0_dequantize(blocks.codes, blocks.d, dtype)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_rows", [4, 7, 36])  # whole 4-row tiles, a remainder, both
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 31])  # input tiles of 8, 4, 2 and 1
def test_fp32_equals_the_dequantized_matmul(
    ops: ModuleType, fmt: str, out_rows: int, rows: int
) -> None:
    blocks, weight = gguf_weight(fmt, out_rows, 96, seed=rows * 100 + out_rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    bias = torch.randn(out_rows, generator=gen)
    for b in (None, bias):
        out = _matmul(ops, blocks, x, b)
        assert out.shape == (rows, out_rows) and out.dtype == torch.float32
        # Exact weights: only the order of the fp32 sums differs.
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_input_rounds_the_fp32_result_once(ops: ModuleType, fmt: str) -> None:
    blocks, _ = gguf_weight(fmt, 64, 128, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    out = _matmul(ops, blocks, x, bias)
    assert out.dtype == torch.bfloat16
    # bf16 activations are exact in fp32, the bias is added before the one rounding.
    assert torch.equal(out, _matmul(ops, blocks, x.float(), bias.float()).bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_exact(ops: ModuleType, fmt: str) -> None:
    blocks, weight = gguf_weight(fmt, 20, 64, seed=9)
    assert torch.equal(_dequantize(ops, blocks, torch.float32), weight)
    assert torch.equal(_dequantize(ops, blocks, torch.bfloat16), weight.bfloat16())
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        _dequantize(ops, blocks, torch.float16)


def test_bad_arguments_are_refused(ops: ModuleType) -> None:
    blocks, _ = gguf_weight("q8_0", 8, 64, seed=1)
    codes, d = blocks.codes, blocks.d
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.q8_0_matmul(torch.zeros(2, 64, dtype=torch.float16), codes, d, None)
    with pytest.raises(RuntimeError, match=r"\[rows, in_features\]"):
        ops.q8_0_matmul(torch.zeros(2, 96), codes, d, None)
    with pytest.raises(RuntimeError, match="codes must be contiguous int8"):
        ops.q8_0_matmul(torch.zeros(2, 64), codes.view(torch.uint8), d, None)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        ops.q8_0_matmul(torch.zeros(2, 64), codes, d.half(), None)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32 or bfloat16"):
        ops.q8_0_matmul(torch.zeros(2, 64), codes, d, torch.zeros(7))
    q4, _ = gguf_weight("q4_1", 8, 64, seed=1)
    assert q4.m is not None
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        ops.q4_1_dequantize(q4.codes.view(torch.int8), q4.d, q4.m, torch.float32)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        ops.q4_1_dequantize(q4.codes, q4.d, q4.m[:, :1].contiguous(), torch.float32)
    with pytest.raises(RuntimeError, match=r"\[rows, in_features\]"):
        ops.q4_1_matmul(torch.zeros(2, 96), q4.codes, q4.d, q4.m, None)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        ops.q4_1_matmul(torch.zeros(2, 64), q4.codes.view(torch.int8), q4.d, q4.m, None)


@pytest.mark.parametrize(
    ("isa", "flags", "exact"),
    [
        ("avx2", ["-march=x86-64-v3"], True),  # same lanes, same fused multiply-adds
        ("plain", ["-march=x86-64"], False),  # no FMA: products rounded before the adds
    ],
)
def test_other_instruction_sets_compute_the_same(
    ops: ModuleType, isa: str, flags: list[str], exact: bool
) -> None:
    """The build for an AVX2-only CPU (and a plain x86-64 one) of the same source, against
    this machine's build: the kernel is one source with three widenings."""
    from torch.utils.cpp_extension import load

    other = load(
        name=f"kvrelay_block_quant_test_{isa}",
        sources=[str(CSRC_CPU / "block_quant_matmul.cpp")],
        extra_cflags=["-O2", *flags, "-fopenmp", "-ffp-contract=fast"],
        verbose=False,
    )
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 128, generator=gen)
    for fmt in FORMATS:
        blocks, weight = gguf_weight(fmt, 36, 128, seed=11)
        assert torch.equal(_dequantize(other, blocks, torch.bfloat16), weight.bfloat16())
        # Sums in 16 logical lanes whatever the vector width: the same bits on every CPU
        # with FMA (AVX-512 builds included; this machine's may be either).
        mine, theirs = _matmul(ops, blocks, x), _matmul(other, blocks, x)
        if exact:
            assert torch.equal(theirs, mine)
        else:
            torch.testing.assert_close(theirs, F.linear(x, weight), rtol=1e-5, atol=1e-5)
