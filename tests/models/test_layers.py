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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_matches_hf(dtype: torch.dtype) -> None:
    """Gemma's `x * (1 + w)` all in fp32, cast back once, as HF's Gemma3RMSNorm (and its
    residual-adding form likewise)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from kvrelay.models.layers import GemmaRMSNorm

    torch.manual_seed(0)
    ours, theirs = GemmaRMSNorm(96, 1e-6), Gemma3RMSNorm(96, eps=1e-6)
    weight = torch.randn(96) * 0.5
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(5, 96) * 3).to(dtype)
    # bf16: one rounding step at most (the fp32 sum's order may differ).
    rtol, atol = (2**-7, 0.0) if dtype == torch.bfloat16 else (1e-6, 1e-6)
    torch.testing.assert_close(ours(x), theirs(x), rtol=rtol, atol=atol)
    residual, delta = x.clone(), torch.ones_like(x)
    added = ours.add_and_norm(residual, delta)
    torch.testing.assert_close(added, theirs(x + 1), rtol=rtol, atol=atol)
    assert torch.equal(residual, x + 1)  # the residual stream updated in place


def test_gemma_embedding_scale_rounds_as_hf() -> None:
    """HF multiplies by the scale rounded to the weights' dtype: the same product in bf16."""
    from kvrelay.models.llama import rounded_to

    torch.manual_seed(0)
    embeds = torch.randn(4, 3840).to(torch.bfloat16)
    hf = embeds * torch.tensor(3840**0.5).to(torch.bfloat16)
    assert rounded_to(3840**0.5, torch.bfloat16) == 62.0
    assert torch.equal(embeds.clone().mul_(rounded_to(3840**0.5, torch.bfloat16)), hf)
    assert not torch.equal(embeds.clone().mul_(3840**0.5), hf)  # unrounded: other products


def test_head_norm_normalizes_each_head() -> None:
    from kvrelay.models.layers import head_norm

    norm = RMSNorm(8, 1e-6)
    norm.weight.data.copy_(torch.arange(8.0))
    x = torch.randn(3, 6, 8)[:, 1:5]  # a non-contiguous view of 4 heads, as q is in qkv
    expected = F.rms_norm(x, (8,), norm.weight, 1e-6)
    torch.testing.assert_close(head_norm(norm, x), expected)
