"""What each supported model family changes in the one decoder (`llama.py`), derived from its
`ModelConfig`: q/k norms, Gemma's norms and embedding scale, the attention scale, per-layer
sliding windows and RoPE tables, soft caps, and the backend capabilities those need.

Plain decisions only: no tensors, no weight loading. Every option here defaults to Llama's
behaviour, so Llama and Qwen2 run exactly the code they ran before the other families came.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.config import ModelConfig

if TYPE_CHECKING:
    from kvrelay_kernels import AttentionBackend

# Checkpoints that store q/k/v and gate/up already fused (kvrelay's own layout).
FUSED_CHECKPOINT_ARCHITECTURES = ("Phi3ForCausalLM",)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
# The families the GGUF loaders carry over (llama.cpp's "llama" tensors and metadata).
GGUF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def has_o_proj_bias(config: ModelConfig) -> bool:
    """`attention_bias` covers o_proj too in HF's Llama, Qwen3 and Gemma; Qwen2's q/k/v bias
    does not (Mistral and Phi-3 have no biases: `ModelConfig` keeps it False for them)."""
    return config.attention_bias and config.architecture != "Qwen2ForCausalLM"


def has_qk_norm(config: ModelConfig) -> bool:
    """Qwen3 and Gemma 3 RMS-normalize each query and key head before RoPE."""
    return config.architecture in QK_NORM_ARCHITECTURES


def attention_scale(config: ModelConfig) -> float:
    """Gemma scales scores by `query_pre_attn_scalar ** -0.5`; the others by head_dim's."""
    scalar = config.query_pre_attn_scalar
    return (scalar if scalar is not None else config.head_dim) ** -0.5


def embedding_scale(config: ModelConfig) -> float | None:
    """Gemma multiplies the embeddings by sqrt(hidden_size) (rounded to the model's dtype
    where it is applied, as HF does); None for the others."""
    return config.hidden_size**0.5 if config.is_gemma else None


def uses_local_rope(config: ModelConfig, layer: int) -> bool:
    """Gemma 3's sliding-window layers rotate with their own base (`rope_local_base_freq`)."""
    return config.local_rope_theta is not None and config.window_of(layer) is not None


def check_backend(config: ModelConfig, backend: AttentionBackend) -> None:
    """Refuse, at load, a backend whose attention lacks a variant this model needs.

    Raises:
        ValueError: naming the backend, the variant and the backend to use instead.
    """
    backend.check_supports(
        sliding_window=bool(config.layer_windows),
        soft_cap=config.attn_logit_softcapping is not None,
    )


def runs_in_decoder_stack(config: ModelConfig) -> bool:
    """Whether the C++ decoder stack (`decoder_stack.py`) computes this model: it implements
    Llama's layer only (plain RMSNorms, silu, full attention at head_dim's scale)."""
    return (
        not config.is_gemma
        and not has_qk_norm(config)
        and not config.layer_windows
        and config.attn_logit_softcapping is None
        and config.final_logit_softcapping is None
        and config.local_rope_theta is None
        and config.hidden_act == "silu"
        and config.query_pre_attn_scalar is None
    )
