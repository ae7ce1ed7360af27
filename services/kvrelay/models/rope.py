"""Rotary position embeddings: inverse frequencies (default, linear, llama3, yarn, longrope), the
attention factor some scalings put on cos/sin, and the cos/sin table.

The table is computed once in fp32 and indexed by position each step; it must match
transformers' rotary embeddings bit for bit in fp32 (the HF comparison tests rely on it).

longrope: transformers picks the long or short factors by the length of each forward call
(`max(position_ids) + 1` against `original_max_position_embeddings`), so a sequence that grows
past that length mid-generation switches factors while its cached keys keep the old rotation.
kvrelay's table is fixed, so it makes vLLM's choice once: the long factors when the table
(the engine's max_model_len) reaches beyond the original length, the short ones otherwise. Both
agree with transformers for every sequence when the table is within the original length, and
for sequences longer than the original length when it is beyond.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from kvrelay_kernels.cpu_fused import fused_ops_for


class RopeFrequencies(NamedTuple):
    inv_freq: torch.Tensor  # [head_dim // 2] fp32
    attention_factor: float  # multiplies cos and sin (yarn's mscale, longrope's factor)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None,
    max_positions: int = 0,
    max_position_embeddings: int | None = None,
) -> RopeFrequencies:
    """The fp32 inverse frequencies and cos/sin factor, with the checkpoint's scaling applied.

    Args:
        max_positions: the table's length (longrope picks its factor set by it).
        max_position_embeddings: the config's, where a scaling without `factor` derives it.

    Raises:
        ValueError: an unsupported `rope_type`.
    """
    # Same expression as transformers (a Python float raised to an fp32 tensor), so the
    # frequencies are identical, not merely close.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if not rope_scaling:
        return RopeFrequencies(1.0 / (theta**exponents), 1.0)
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return RopeFrequencies(1.0 / (theta**exponents), 1.0)
    if rope_type == "linear":
        return RopeFrequencies(1.0 / (theta**exponents) / float(rope_scaling["factor"]), 1.0)
    if rope_type == "llama3":
        return RopeFrequencies(_llama3_inv_freq(1.0 / (theta**exponents), rope_scaling), 1.0)
    if rope_type == "yarn":
        return _yarn(exponents, theta, rope_scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(exponents, theta, rope_scaling, max_positions, max_position_embeddings)
    raise ValueError(
        f"config.json: unsupported rope_scaling type {rope_type!r}; kvrelay supports default, "
        "linear, llama3, yarn and longrope (remove or change `rope_scaling` / `rope_parameters`)"
    )


def _scaling_factor(scaling: dict[str, Any], max_position_embeddings: int | None) -> float:
    """`factor`, or max_position_embeddings / original_max_position_embeddings without it."""
    factor = scaling.get("factor")
    if factor is not None:
        return float(factor)
    if max_position_embeddings is None:
        raise ValueError("rope_scaling has no factor and max_position_embeddings is unknown")
    return max_position_embeddings / float(scaling["original_max_position_embeddings"])


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    exponents: torch.Tensor,
    theta: float,
    scaling: dict[str, Any],
    max_position_embeddings: int | None,
) -> RopeFrequencies:
    """YaRN (transformers' `_compute_yarn_parameters`, expression for expression): low
    frequencies interpolated by `factor`, high ones kept, a linear ramp between the
    dimensions that turn `beta_slow` and `beta_fast` times over the original context."""
    factor = _scaling_factor(scaling, max_position_embeddings)
    dim = 2 * exponents.numel()
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    steps = torch.arange(dim // 2, dtype=torch.float32, device="cpu")  # real under meta too
    ramp = torch.clamp((steps - low) / (high - low), 0, 1)
    pos_freqs = theta**exponents
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope(
    exponents: torch.Tensor,
    theta: float,
    scaling: dict[str, Any],
    max_positions: int,
    max_position_embeddings: int | None,
) -> RopeFrequencies:
    """LongRoPE (Phi-3): per-frequency divisors, long or short by the table's length (see the
    module docstring), and transformers' attention factor."""
    original = int(scaling["original_max_position_embeddings"])
    factor = _scaling_factor(scaling, max_position_embeddings)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    name = "long_factor" if max_positions > original else "short_factor"
    factors = scaling.get(name)
    if not isinstance(factors, list) or len(factors) != exponents.numel():
        raise ValueError(
            f"rope_scaling.{name} must list {exponents.numel()} numbers (head_dim / 2), got "
            f"{factors!r}"
        )
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return RopeFrequencies(1.0 / (ext * theta**exponents), float(attention_factor))


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
        max_position_embeddings: int | None = None,
    ) -> None:
        """`max_position_embeddings`: the config's (yarn and longrope derive a missing
        `factor` from it); `max_positions` is the table's length."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq, factor = rope_inv_freq(
            head_dim, theta, rope_scaling, max_positions, max_position_embeddings
        )
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:  # as transformers: scaled in fp32, before any cast
            cos, sin = cos * factor, sin * factor
        # Only half the table is stored: HF's cos/sin repeat it twice along head_dim.
        # Not persistent: they are derived from the config, never loaded from a checkpoint.
        # The explicit CPU device keeps them real when the model is built on the meta device,
        # and matches transformers' CPU arithmetic bit for bit; `model.to(device)` (the
        # loader) moves them to the weights' device once, so `cos_sin` never crosses devices.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
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
