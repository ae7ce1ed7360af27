"""Tiny random Llama / Qwen2 checkpoints in HF's format, written by transformers itself: the
shapes the decoder tests cover (GQA, untied heads, biases, a head_dim apart from hidden / heads,
RoPE scalings)."""

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
}


def make_checkpoint(folder: Path, family: str, overrides: dict[str, Any]) -> Any:
    """Write a random HF checkpoint to `folder` and return the HF model (eval, fp32)."""
    import transformers

    torch.manual_seed(0)
    kwargs = {**BASE, **overrides}
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
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
