"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and a cos/sin table.

The table is computed once in fp32 and indexed by position each step; it must match
transformers' `LlamaRotaryEmbedding` bit for bit in fp32 (the HF comparison tests rely on it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvrelay_kernels.cpu_fused import fused_ops_for


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """The `[head_dim // 2]` fp32 inverse frequencies, with the checkpoint's scaling applied.

    Raises:
        ValueError: an unsupported `rope_type` (kvrelay runs default, linear and llama3).
    """
    # Same expression as transformers (a Python float raised to an fp32 tensor), so the
    # frequencies are identical, not merely close.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; kvrelay supports default, linear and "
        "llama3 (remove or change `rope_scaling` in config.json)"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp
    between them (the formula of Meta's reference implementation)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The RoPE cos/sin table (HF Llama's "rotate half" layout); `apply_rope` uses its rows."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        rope_scaling: dict[str, Any] | None,
        max_positions: int,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        # Only half the table is stored: HF's cos/sin repeat it twice along head_dim.
        # Not persistent: they are derived from the config, never loaded from a checkpoint.
        # The explicit CPU device keeps them real when the model is built on the meta device,
        # and matches transformers' CPU arithmetic bit for bit; `model.to(device)` (the
        # loader) moves them to the weights' device once, so `cos_sin` never crosses devices.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Gather the step's rows once; every layer reuses them. Returns two `[T, 1, D/2]`."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [T, heads, head_dim]` by `cos, sin: [T, 1, head_dim // 2]`.

    Returns a new contiguous tensor shaped like `x`. With `x = [x1, x2]` (halves of head_dim),
    HF computes `x * [c, c] + [-x2, x1] * [s, s]`; writing each half straight into the output
    avoids the `cat` of `rotate_half`.
    """
    fused = fused_ops_for(x)
    if fused is not None and cos.dtype == x.dtype and x.stride(-1) == 1:
        rotated: torch.Tensor = fused.rope(x, cos, sin)  # the same roundings, one call
        return rotated
    return apply_rope_with_torch_ops(x, cos, sin)


def apply_rope_with_torch_ops(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """`apply_rope` in torch ops (any device and dtype); the fused CPU op rounds as this does."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out
