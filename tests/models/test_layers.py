"""Unit checks of the decoder's building blocks against their plain torch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.layers import SMALL_BATCH_ROWS, RMSNorm, linear
from kvrelay.models.rope import apply_rope, rope_inv_freq


@pytest.mark.parametrize("rows", [1, 2, 3, SMALL_BATCH_ROWS - 1, SMALL_BATCH_ROWS, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen)
    weight = torch.randn(40, 48, generator=gen)
    bias = torch.randn(40, generator=gen) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_apply_rope_matches_rotate_half() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen)  # [T, heads, head_dim]
    positions = torch.tensor([0, 1, 7, 8, 100])
    freqs = positions[:, None].float() * rope_inv_freq(16, 10000.0, None).inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1).unsqueeze(1)  # [T, 1, head_dim]
    rotated = torch.cat((-x[..., 8:], x[..., :8]), -1)
    expected = x * emb.cos() + rotated * emb.sin()
    got = apply_rope(x, freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1))
    torch.testing.assert_close(got, expected)


def test_unknown_rope_type_says_what_is_supported() -> None:
    with pytest.raises(ValueError, match="yarn and longrope"):
        rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 4.0})


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_dense(rows: int, bias: bool) -> None:
    from kvrelay.models.layers import Linear, can_prepack

    layer = Linear(48, 80, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    x = torch.randn(rows, 48)
    dense = layer(x)
    layer.prepack()  # kvrelay's blocked kernel where it builds, else oneDNN's packed copy
    if layer.blocked is None and not can_prepack(layer.weight):
        pytest.skip("neither kernel is available on this CPU / torch build")
    assert (layer.blocked is None) is (layer.packed is not None)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    """Ours takes torch's fused kernel in every dtype; HF's LlamaRMSNorm is the reference
    (fp32 math, cast back, then the weight), to the last bit in bf16."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    weight = torch.randn(576) * 0.5 + 1
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(7, 576) * 3).to(dtype)
    expected = theirs(x)
    got = ours(x)
    assert got.dtype == expected.dtype == dtype
    if dtype == torch.bfloat16:
        # One bf16 rounding step at most (the fp32 sum's order may differ).
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)
        assert (got == expected).float().mean() > 0.99
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
