"""yarn and longrope frequencies and attention factors equal to transformers' own functions
(bit for bit, in fp32), longrope's fixed choice of factor set, and how ModelConfig reads each
family's config.json layouts (transformers 4's and 5's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrelay.config import ModelConfig
from kvrelay.models.rope import RotaryEmbedding, rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SHAPE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 32: 16 frequencies
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
YARNS = [
    {"factor": 4.0, "original_max_position_embeddings": 1024},
    {"factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2},
    {"factor": 2.0, "original_max_position_embeddings": 2048, "truncate": False},
    {"factor": 16.0, "original_max_position_embeddings": 256, "mscale": 0.7, "mscale_all_dim": 1},
    {"factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.5},
    # Equal betas: the narrowest ramp (one or two dimensions wide after truncation).
    {"factor": 32.0, "original_max_position_embeddings": 128, "beta_fast": 4, "beta_slow": 4},
]


def _hf(config: Any, **kwargs: Any) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq, float(factor)


@pytest.mark.parametrize("scaling", YARNS)
def test_yarn_equals_transformers(scaling: dict[str, Any]) -> None:
    hf_config = transformers.Qwen2Config(
        **SHAPE, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **scaling}
    )
    raw = {**hf_config.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    config = ModelConfig.from_hf_config(raw)
    assert config.rope_scaling is not None
    ours = rope_inv_freq(32, config.rope_theta, config.rope_scaling, 4096, 4096)
    expected, factor = _hf(hf_config)
    assert torch.equal(ours.inv_freq, expected)
    assert ours.attention_factor == factor
    assert factor != 1.0 or "attention_factor" in scaling


@pytest.mark.parametrize("table", [100, 4096])
def test_longrope_picks_one_factor_set_by_the_table_length(table: int) -> None:
    """transformers switches by each call's length (seq_len); kvrelay by the table's: the
    short set for a table within the original 256 positions, the long set beyond it."""
    hf_config = transformers.Phi3Config(
        **SHAPE,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
        original_max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0 + i / 10 for i in range(16)],
            "long_factor": [2.0 + i for i in range(16)],
        },
    )
    raw = {**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    config = ModelConfig.from_hf_config(raw)
    ours = rope_inv_freq(32, config.rope_theta, config.rope_scaling, table, 4096)
    expected, factor = _hf(hf_config, seq_len=table)  # transformers' pick for that length
    assert torch.equal(ours.inv_freq, expected)
    assert ours.attention_factor == factor == pytest.approx((1 + 2.772588 / 5.545177) ** 0.5)
    # The table carries the factor on cos and sin, as transformers' forward does.
    rotary = RotaryEmbedding(32, config.rope_theta, config.rope_scaling, table, 4096)
    freqs = torch.arange(table, dtype=torch.float32)[:, None] * expected[None, :]
    assert torch.equal(rotary.cos, freqs.cos() * factor)


def test_longrope_factor_lists_must_fit_the_head() -> None:
    with pytest.raises(ValueError, match="short_factor must list 16"):
        rope_inv_freq(
            32,
            1e4,
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0],
                "original_max_position_embeddings": 64,
            },
            64,
            128,
        )


def test_gemma3_transformers4_layout() -> None:
    """A Hub Gemma 3 config.json (transformers 4): rope_theta with linear scaling for the
    global layers, rope_local_base_freq for the local ones, sliding_window_pattern."""
    config = ModelConfig.from_hf_config(
        {
            **SHAPE,
            "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": 6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 512,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 256,
        }
    )
    assert config.rope_theta == 1_000_000.0 and config.local_rope_theta == 10_000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.layer_windows == (512, 512, None, 512, 512, None)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    assert config.attn_logit_softcapping is None and config.query_pre_attn_scalar == 256


def test_gemma2_defaults_follow_transformers() -> None:
    config = ModelConfig.from_hf_config({**SHAPE, "architectures": ["Gemma2ForCausalLM"]})
    hf = transformers.Gemma2Config(**SHAPE)
    assert config.attn_logit_softcapping == hf.attn_logit_softcapping == 50.0
    assert config.final_logit_softcapping == hf.final_logit_softcapping == 30.0
    assert config.layer_windows == (4096, None) and config.head_dim == hf.head_dim == 256


def test_qwen_window_needs_use_sliding_window() -> None:
    """Qwen configs carry sliding_window with use_sliding_window false: no window then."""
    base = {**SHAPE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_hf_config(base).layer_windows == ()
    windowed = {**base, "use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_hf_config(windowed).layer_windows == (None, 64)


@pytest.mark.parametrize("name", ["longrope", "su", "yarn"])
def test_phi3_top_level_original_length_wins(name: str) -> None:
    """transformers' rules: Phi-3's top-level original_max_position_embeddings overrides the
    one inside rope_scaling; its older type names "su" and "yarn" mean longrope."""
    config = ModelConfig.from_hf_config(
        {
            **SHAPE,
            "architectures": ["Phi3ForCausalLM"],
            "original_max_position_embeddings": 512,
            "rope_scaling": {
                "type": name,
                "short_factor": [1.0] * 16,
                "long_factor": [2.0] * 16,
                "original_max_position_embeddings": 99,
            },
        }
    )
    assert config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == 512
    assert config.rope_scaling["rope_type"] == "longrope"
    hf = transformers.Phi3Config(
        **SHAPE,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
        original_max_position_embeddings=512,
        rope_scaling={"type": name, "short_factor": [1.0] * 16, "long_factor": [2.0] * 16},
    )
    assert hf.rope_parameters["rope_type"] == "longrope"
