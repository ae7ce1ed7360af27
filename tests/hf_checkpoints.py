"""Tiny random checkpoints of every supported family in HF's format, written by transformers
itself: the shapes the decoder tests cover (GQA, untied heads, biases, a head_dim apart from
hidden / heads, RoPE scalings, q/k norms, Gemma's norms and caps, sliding windows shorter than
the tests' sequences)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}

# Phi-3's config defaults its special tokens to ids beyond the tiny vocabulary.
PHI3_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-tied": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "llama-mha-untied": ("llama", {"tie_word_embeddings": False, "rope_theta": 500.0}),
    "llama3-rope-headdim-bias": (
        "llama",
        {
            # head_dim 24 != hidden / heads = 16; one KV head for all four query heads.
            "head_dim": 24,
            "num_key_value_heads": 1,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            # A small original context puts the test's positions in all three llama3 bands.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-linear-rope": (
        "llama",
        {"num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "qwen2-bias-gqa": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-yarn": (
        "qwen2",
        {
            "num_key_value_heads": 2,
            # A small original context puts the test's positions past it; beta_* move the ramp.
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 8.0,
                "beta_slow": 2.0,
            },
        },
    ),
    "llama-yarn-mscale": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        },
    ),
    "qwen3-qknorm-headdim": (
        "qwen3",
        {"num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": False},
    ),
    "qwen3-yarn-tied": (
        "qwen3",
        {
            "head_dim": 16,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral-no-window": ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
    # Both longrope sets: the short one (table within the original length, every sequence
    # there too), the long one (every test sequence beyond the original length of 4).
    "phi3-longrope-short": (
        "phi3",
        {
            **PHI3_TOKENS,
            "num_key_value_heads": 2,
            "original_max_position_embeddings": 128,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 1.0, 3.0, 1.2, 1.0, 4.0],
                "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
                "attention_factor": 1.25,
            },
        },
    ),
    "phi3-longrope-long": (
        "phi3",
        {
            **PHI3_TOKENS,
            "original_max_position_embeddings": 4,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 6.0, 12.0, 24.0],
            },
        },
    ),
}

# Cases whose layers have a sliding window (5 tokens: the tests' sequences run to 23) or soft
# caps; they need a backend with those attention variants.
WINDOWED_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", {"num_key_value_heads": 2, "sliding_window": 5}),
    "phi3-window": ("phi3", {**PHI3_TOKENS, "sliding_window": 6}),
    "qwen3-window-layers": (
        "qwen3",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "gemma2-caps": (
        "gemma2",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 24,
            # Caps near the scores' and logits' size, so the tanh bends them.
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3-local-rope": (
        "gemma3",
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    ),
    "gemma3-final-cap-tied": (
        "gemma3",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "sliding_window_pattern": 2,
            "final_logit_softcapping": 3.0,
        },
    ),
}

_CLASSES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
}


def architecture_of(family: str) -> str:
    """The HF architecture name `make_checkpoint` writes for `family`."""
    return _CLASSES[family][0]


def make_checkpoint(folder: Path, family: str, overrides: dict[str, Any]) -> Any:
    """Write a random HF checkpoint to `folder` and return the HF model (eval, fp32)."""
    import transformers

    torch.manual_seed(0)
    kwargs = {**BASE, **overrides}
    model_class, config_class = _CLASSES[family]
    config = getattr(transformers, config_class)(**kwargs)
    # Eager attention: the reference definition (sdpa would differ only in roundings).
    config._attn_implementation = "eager"
    model = getattr(transformers, model_class)(config)
    # HF's init (std 0.02) gives near-zero logits that would hide a wrong layout; larger
    # weights make every part of the computation show in the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def assert_mixed_steps_match_hf(model: Any, hf_model: Any, paged_kv: Any, label: str) -> None:
    """`model`'s logits within 1e-4 of `hf_model`'s (one whole-sequence forward each) through
    a paged cache: prefill chunks, chunks crossing blocks and decodes mixed in three steps,
    over sequences of 23, 11 and 6 tokens (longer than the cases' sliding windows)."""
    gen = torch.Generator().manual_seed(1)
    seqs = {
        "a": torch.randint(0, BASE["vocab_size"], (23,), generator=gen).tolist(),
        "b": torch.randint(0, BASE["vocab_size"], (11,), generator=gen).tolist(),
        "c": torch.randint(0, BASE["vocab_size"], (6,), generator=gen).tolist(),
    }
    with torch.inference_mode():
        reference = {s: hf_model(torch.tensor([ids])).logits[0] for s, ids in seqs.items()}

    kv = paged_kv(model, num_blocks=32, block_size=4, seed=7)
    a, b, c = seqs["a"], seqs["b"], seqs["c"]
    steps = [
        # A's first prefill chunk, B's whole prompt, C's prompt: prefill only.
        [("a", a[:13]), ("b", b[:9]), ("c", c[:4])],
        # B decodes while A prefills its second chunk (which crosses block boundaries).
        [("b", b[9:10]), ("a", a[13:22]), ("c", c[4:5])],
        # Decode only.
        [("a", a[22:23]), ("b", b[10:11]), ("c", c[5:6])],
    ]
    for step in steps:
        start = {s: kv.lens.get(s, 0) for s, _ in step}
        logits = kv.forward_logits(model, step)
        row = 0
        for seq, tokens in step:
            expected = reference[seq][start[seq] : start[seq] + len(tokens)]
            got = logits[row : row + len(tokens)]
            row += len(tokens)
            diff = (got - expected).abs().max().item()
            assert diff <= 1e-4, f"{label}: {seq} at {start[seq]}: max abs diff {diff}"
        assert logits.dtype == torch.float32
