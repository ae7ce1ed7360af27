"""bf16 on the CPU: feature detection, and the packed bf16 linear paths (oneDNN's, and kvrelay's
blocked kernel where it builds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.cpu_features import cpu_flags, cpu_has_native_bf16, has_native_bf16_flags
from kvrelay.models.layers import Linear, PackedLinear, can_prepack

_ZEN4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
_ZEN2 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\nprocessor\t: 1\nflags\t\t: fpu sse avx2 fma\n"
_ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"

native_bf16 = pytest.mark.skipif(
    not cpu_has_native_bf16(), reason="this CPU has no AVX512-BF16/AMX-BF16/Arm BF16"
)


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    assert {"avx512_bf16", "avx2"} <= cpu_flags(_ZEN4)
    assert cpu_flags(_ZEN2) == frozenset({"fpu", "sse", "avx2", "fma"})
    assert "bf16" in cpu_flags(_ARM)
    assert cpu_flags("") == frozenset()


@pytest.mark.parametrize(("text", "native"), [(_ZEN4, True), (_ZEN2, False), (_ARM, True)])
def test_native_bf16_needs_a_bf16_instruction_set(text: str, native: bool) -> None:
    assert has_native_bf16_flags(cpu_flags(text)) is native


def test_cpu_has_native_bf16_agrees_with_this_machine() -> None:
    # The real check on whatever CPU runs the suite (AVX2-only CI machines say False).
    flags = cpu_flags()
    expected = has_native_bf16_flags(flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_has_native_bf16() is expected


def test_fp32_always_prepacks_and_bf16_only_with_native_support() -> None:
    assert can_prepack(torch.zeros(16, 16))
    assert can_prepack(torch.zeros(16, 16, dtype=torch.bfloat16)) is cpu_has_native_bf16()
    assert not can_prepack(torch.zeros(16, 16, dtype=torch.float16))


def _layer(dtype: torch.dtype, bias: bool) -> Linear:
    gen = torch.Generator().manual_seed(3)
    layer = Linear(64, 48, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen) * 0.1)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(48, generator=gen))
    return layer.to(dtype)


@native_bf16
@pytest.mark.parametrize("rows", [1, 4, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_fp32_math_within_bf16_rounding(rows: int, bias: bool) -> None:
    layer = _layer(torch.bfloat16, bias)
    onednn = PackedLinear(layer.weight, layer.bias)
    assert onednn.single_row  # bf16: packed even for 1 row
    layer.prepack()  # kvrelay's blocked kernel where it builds, else a oneDNN copy
    assert (layer.blocked is None) is (layer.packed is not None)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    b = layer.bias.float() if layer.bias is not None else None
    expected = F.linear(x.float(), layer.weight.float(), b)
    with torch.inference_mode():
        for out in (onednn.forward(x), layer(x)):
            assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
            # fp32 accumulation, one bf16 rounding of the output (8-bit mantissa: 2^-8).
            torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2e-2)


def test_fp32_single_row_keeps_the_dense_path() -> None:
    layer = _layer(torch.float32, bias=True)
    assert not PackedLinear(layer.weight, layer.bias).single_row  # single_row.py measures it
    layer.prepack()
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
