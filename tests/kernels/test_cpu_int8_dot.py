"""The CPU int8-activation kernel (csrc_cpu/int8_dot_matmul.cpp): its quantization of the
activations bit for bit against the scheme written in torch, its matmuls over the weights'
panels against that scheme computed in float64 (integer dots are exact, so only fp32 rounding
may differ), the error the scheme itself makes against the exact weights, the panel layout,
and the AVX2 and plain x86-64 builds."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.gguf_blocks import (
    GgufBlocks,
    QuantizedWeightError,
)
from kvrelay.models.quantized import int8_panels
from kvrelay_kernels.cpu_extension import CSRC_CPU, headers_flag
from kvrelay_kernels.cpu_quantized import load_int8_dot_ops
from tests.kernels.gguf_weights import FORMATS, gguf_weight


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    module = load_int8_dot_ops()
    assert module is not None, "the CPU int8 kernel did not build (is a C++ compiler there?)"
    return module


def _matmul(
    ops: ModuleType, blocks: GgufBlocks, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W.T` by `ops`, the weight repacked into panels."""
    panels = int8_panels(blocks)
    out: torch.Tensor
    if panels.m is not None:
        out = ops.q4_1_int8_matmul(x, panels.codes, panels.d, panels.m, bias)
    else:
        out = ops.q8_0_int8_matmul(x, panels.codes, panels.d, bias)
    return out


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scheme in torch: per 32 values d = max|x| / 127, q = round-half-even(x * (1 / d))."""
    rows, k = x.shape
    cells = x.float().reshape(rows, k // 32, 32)
    d = cells.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(cells * inverse[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(rows, k), d, q.sum(-1).to(torch.int32)


def _scheme(x: torch.Tensor, blocks: GgufBlocks) -> torch.Tensor:
    """`x @ W.T` as the scheme defines it, in float64: per block dw * dx * sum(qw * qx), plus
    m * dx * sum(qx) for Q4_1."""
    q, dx, sums = _quantize(x)
    rows, k = x.shape
    qx = q.double().reshape(rows, k // 32, 32)
    if blocks.m is not None:
        cells = blocks.codes.reshape(-1, k // 32, 16)
        qw = torch.cat((cells & 15, cells >> 4), dim=-1).double()  # element order
    else:
        qw = blocks.codes.reshape(-1, k // 32, 32).double()
    dots = torch.einsum("tbi,nbi->tnb", qx, qw)
    out = (dots * (blocks.d.double()[None] * dx.double()[:, None])).sum(-1)
    if blocks.m is not None:
        out += (blocks.m.double()[None] * (dx.double() * sums.double())[:, None]).sum(-1)
    return out


def _assert_matches_scheme(got: torch.Tensor, x: torch.Tensor, blocks: GgufBlocks) -> None:
    expected = _scheme(x, blocks)
    # The integer dots are exact; fp32 products and sums differ from float64 by rounding.
    tolerance = 2e-6 * expected.abs().max().item() + 1e-6
    assert (got.double() - expected).abs().max().item() <= tolerance


def test_the_activation_codes_are_the_scheme_bit_for_bit(ops: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 160, generator=gen) * torch.logspace(-3, 3, 160)
    x[2, 32:64] = 0  # a block of zeros: scale 0, codes 0
    x[3, :32] = torch.arange(32) - 15.5  # exact halves: ties go to even
    for rows in (x, x.bfloat16()):
        codes, scales, sums = ops.int8_quantize(rows)
        expected = _quantize(rows.float())
        assert torch.equal(codes, expected[0])
        assert torch.equal(scales, expected[1])
        assert torch.equal(sums, expected[2])
    assert int(codes.abs().max()) == 127 and torch.equal(scales[2, 1], torch.tensor(0.0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_features", [32, 96, 576])
@pytest.mark.parametrize("out_rows", [16, 48, 160])  # one panel; pairs and a lone one
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 31, 40])  # tiles of 4, 2 and 1
def test_matmul_equals_the_scheme(
    ops: ModuleType, fmt: str, in_features: int, out_rows: int, rows: int
) -> None:
    blocks, _ = gguf_weight(fmt, out_rows, in_features, seed=rows * 100 + out_rows + in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = _matmul(ops, blocks, x)
    assert out.shape == (rows, out_rows) and out.dtype == torch.float32
    _assert_matches_scheme(out, x, blocks)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_error_is_the_activations_rounding_alone(ops: ModuleType, fmt: str) -> None:
    """Against the exact weights, each block's error is at most sum|w| * dx / 2 (a code is
    off by at most half a step); and it is not zero (the test would catch an exact path)."""
    blocks, weight = gguf_weight(fmt, 64, 256, seed=3)  # 64 rows: four panels
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    got = _matmul(ops, blocks, x).double()
    exact = F.linear(x.double(), weight.double())
    _, dx, _ = _quantize(x)
    bound = torch.einsum(
        "tb,nb->tn", dx.double() / 2, weight.double().abs().reshape(64, 8, 32).sum(-1)
    )
    error = (got - exact).abs()
    assert bool((error <= bound * 1.001 + 1e-5).all())
    assert error.max().item() > 1e-6


def test_q8_0_codes_of_minus_128_count_as_such(ops: ModuleType) -> None:
    # gguf never writes -128, but a file may hold it: the unsigned shift must not wrap.
    codes = torch.full((16, 64), -128, dtype=torch.int8)
    codes[1] = 127
    codes[2, 1::2] = 5
    d = torch.full((16, 2), 0.5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    blocks = GgufBlocks(codes, d, None)
    _assert_matches_scheme(_matmul(ops, blocks, x), x, blocks)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bias_and_bf16_round_once(ops: ModuleType, fmt: str) -> None:
    blocks, _ = gguf_weight(fmt, 64, 128, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen)
    out = _matmul(ops, blocks, x, bias.bfloat16())
    assert out.dtype == torch.bfloat16
    # bf16 activations are exact in fp32; the bias is added before the one rounding.
    fp32 = _matmul(ops, blocks, x.float(), bias.bfloat16().float())
    assert torch.equal(out, fp32.bfloat16())
    torch.testing.assert_close(fp32 - bias.bfloat16().float(), _matmul(ops, blocks, x.float()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_input_poisons_its_row_only(ops: ModuleType, fmt: str) -> None:
    blocks, _ = gguf_weight(fmt, 16, 64, seed=6)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    for bad in (float("nan"), float("inf")):
        poisoned = x.clone()
        poisoned[1, 40] = bad
        out = _matmul(ops, blocks, poisoned)
        assert bool(out[1].isnan().all())
        assert torch.equal(out[[0, 2]], _matmul(ops, blocks, x)[[0, 2]])


def test_panels_hold_each_rows_words_side_by_side() -> None:
    # Q8_0 codes 0..31 in every block of row r + 1 (scaled by r): word j of row i of a panel
    # is bytes 4j..4j+3 of that row's block.
    codes = (torch.arange(32, dtype=torch.int8).repeat(32, 3)).contiguous()
    d = torch.arange(32, dtype=torch.float32)[:, None].repeat(1, 3)
    panels = int8_panels(GgufBlocks(codes, d, None))
    assert panels.codes.shape == (2, 3 * 8 * 16 * 4) and panels.m is None
    cells = panels.codes.reshape(2, 3, 8, 16, 4)
    assert cells[1, 2, 5, 7].tolist() == [20, 21, 22, 23]
    assert panels.d.dtype == torch.float16 and panels.d.reshape(2, 3, 16)[1, 0, 7] == 23
    q4, _ = gguf_weight("q4_1", 32, 64, seed=7)
    assert q4.m is not None
    q4_panels = int8_panels(q4)
    assert q4_panels.m is not None and q4_panels.codes.shape == (2, 2 * 4 * 16 * 4)
    row, block = 16 + 5, 1  # panel 1, row 5: its GGUF bytes 4..7 are word 1
    word = q4_panels.codes.reshape(2, 2, 4, 16, 4)[1, block, 1, 5]
    assert torch.equal(word, q4.codes[row, block * 16 + 4 : block * 16 + 8])
    assert q4_panels.m.reshape(2, 2, 16)[1, block, 5] == q4.m[row, block].half()


def test_bad_arguments_are_refused(ops: ModuleType) -> None:
    q8_blocks, _ = gguf_weight("q8_0", 16, 64, seed=1)
    q8 = int8_panels(q8_blocks)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.q8_0_int8_matmul(torch.zeros(2, 64, dtype=torch.float16), q8.codes, q8.d, None)
    with pytest.raises(RuntimeError, match=r"\[rows, in_features\]"):
        ops.q8_0_int8_matmul(torch.zeros(2, 96), q8.codes, q8.d, None)
    with pytest.raises(RuntimeError, match="panel codes must be contiguous uint8"):
        ops.q8_0_int8_matmul(torch.zeros(2, 64), q8.codes.view(torch.int8), q8.d, None)
    with pytest.raises(RuntimeError, match="panel scales must be contiguous float16"):
        ops.q8_0_int8_matmul(torch.zeros(2, 64), q8.codes, q8.d.float(), None)
    with pytest.raises(RuntimeError, match="bias must be float32 or bfloat16"):
        ops.q8_0_int8_matmul(torch.zeros(2, 64), q8.codes, q8.d, torch.zeros(7))
    q4_blocks, _ = gguf_weight("q4_1", 16, 64, seed=1)
    q4 = int8_panels(q4_blocks)
    assert q4.m is not None
    with pytest.raises(RuntimeError, match="panel scales must be contiguous float16"):
        ops.q4_1_int8_matmul(torch.zeros(2, 64), q4.codes, q4.d, q4.m[:, :1].contiguous(), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.int8_quantize(torch.zeros(2, 48))
    few, _ = gguf_weight("q4_1", 8, 64, seed=1)  # panels take whole 16-row groups
    with pytest.raises(QuantizedWeightError, match="panels of 16"):
        int8_panels(few)


@pytest.mark.parametrize("isa", ["avx2", "plain"])
def test_other_instruction_sets_compute_the_same(ops: ModuleType, isa: str) -> None:
    """The builds for an AVX2-only CPU (vpmaddubsw) and a plain x86-64 one (C++ loops) of the
    same source: the same activation codes, and the scheme's result to fp32 rounding."""
    from torch.utils.cpp_extension import load

    flags = {"avx2": ["-march=x86-64-v3"], "plain": ["-march=x86-64"]}[isa]
    other = load(
        name=f"kvrelay_int8_dot_test_{isa}",
        sources=[str(CSRC_CPU / "int8_dot_matmul.cpp")],
        # headers_flag: torch keys its cache on the source, not on int8_activations.h
        extra_cflags=["-O2", *flags, "-fopenmp", "-ffp-contract=fast", headers_flag()],
        verbose=False,
    )
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 96, generator=gen)
    for mine, theirs in zip(ops.int8_quantize(x), other.int8_quantize(x), strict=True):
        assert torch.equal(mine, theirs)
    for fmt in FORMATS:
        blocks, _ = gguf_weight(fmt, 48, 96, seed=11)
        _assert_matches_scheme(_matmul(other, blocks, x), x, blocks)
        torch.testing.assert_close(_matmul(other, blocks, x), _matmul(ops, blocks, x))
