"""Unit checks of the decoder's building blocks against their plain torch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.layers import SMALL_BATCH_ROWS, linear
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
    freqs = positions[:, None].float() * rope_inv_freq(16, 10000.0, None)[None, :]
    emb = torch.cat((freqs, freqs), -1).unsqueeze(1)  # [T, 1, head_dim]
    rotated = torch.cat((-x[..., 8:], x[..., :8]), -1)
    expected = x * emb.cos() + rotated * emb.sin()
    got = apply_rope(x, freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1))
    torch.testing.assert_close(got, expected)


def test_unknown_rope_type_says_what_is_supported() -> None:
    with pytest.raises(ValueError, match="llama3"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})


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
    layer.prepack()
    if not can_prepack(layer.weight):
        pytest.skip("oneDNN is not available in this torch build")
    assert layer.packed is not None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), dense, atol=1e-5, rtol=1e-5)
