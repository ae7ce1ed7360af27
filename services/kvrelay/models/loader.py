"""Load a Hugging Face checkpoint folder (config.json + safetensors) of any supported family
into `CausalLM`.

Maps HF weight names to the model's, fusing q/k/v and gate/up on the way (Phi-3 stores them
fused already). Safetensors only: this module never unpickles anything.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvrelay.config import ModelConfig
from kvrelay.models.families import (
    FUSED_CHECKPOINT_ARCHITECTURES,
    check_backend,
    has_o_proj_bias,
    has_qk_norm,
)
from kvrelay.models.gguf_convert import GgufFile
from kvrelay.models.llama import CausalLM
from kvrelay.models.quantized_loading import (
    check_int8_activations,
    install_quantized_linears,
    install_quantized_logits,
    read_quantized_weights,
)
from kvrelay.models.weight_arena import gather_weights
from kvrelay_kernels import AttentionBackend

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Derived from the config, never needed from the checkpoint (older HF exports still save it).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class MissingWeightError(ValueError):
    """The checkpoint lacks a weight that its config.json says the model has."""


def load_model(
    folder: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    int8_activations: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """Build the decoder described by `folder/config.json` and load its weights.

    Args:
        folder: a Hugging Face model folder: config.json, *.safetensors (an index if sharded).
        backend: the kernel ops the attention layers call.
        dtype: the dtype of every weight (converted on load).
        max_positions: size of the RoPE table; `max_position_embeddings` when None. Pass the
            engine's max_model_len to keep the table small for long-context checkpoints.
        device: where the weights go; safetensors reads them straight there (no CPU copy of
            the whole model on the way), and the RoPE table follows.
        quantization: None or "none": the safetensors weights; "q4_1": the folder's GGUF,
            its Q4_1 matmul weights kept 4-bit (`kvrelay.models.quantized_loading`); "auto":
            that where the folder holds a GGUF with Q4_1 weights.
        int8_activations: the quantized layers' few-row steps quantize their inputs to int8
            and multiply by integer dot products (faster, not exact; needs `quantization`).

    Returns:
        The model in eval mode, and its config.

    Raises:
        FileNotFoundError: no config.json or no safetensors file in `folder`.
        kvrelay.config.UnsupportedModelError: an architecture kvrelay does not run.
        MissingWeightError: a weight the config implies is absent from the checkpoint.
        ValueError: the checkpoint holds weights this model has no place for, or `backend`
            lacks an attention variant (sliding window, soft cap) the model needs.
        kvrelay.models.quantized_loading.QuantizationError: an unknown quantization, no GGUF
            with such weights (or of this family), or int8 activations without either.
    """
    check_int8_activations(quantization, int8_activations)
    config = ModelConfig.from_pretrained(folder)
    check_backend(config, backend)  # before reading gigabytes of weights
    hf_weights, gguf, count = _read_weights(folder, quantization, config, torch.device(device))
    source = gguf.path if gguf is not None else folder
    state = convert_hf_state_dict(hf_weights, config, dtype, source=str(source))
    del hf_weights
    # Built on the meta device: no memory and no random init for weights that the checkpoint
    # replaces right away (`assign=True` adopts the loaded tensors as the parameters).
    with torch.device("meta"):
        model = CausalLM(config, backend, max_positions)
    install_quantized_linears(model, state, dtype, int8_activations)  # pops them from state
    model.load_state_dict(state, strict=True, assign=True)
    assert not any(p.is_meta for p in model.parameters()), "a parameter was left unloaded"
    if gguf is not None:
        install_quantized_logits(model, gguf, dtype, int8_activations)
    # The weights are already there; this moves the RoPE buffers (built on the CPU for
    # bit-exactness with transformers) and is free on the CPU.
    model.to(device)
    model.eval().requires_grad_(False)
    gather_weights(model)  # CPU weights into one huge-page run, in the order a step reads them
    logger.info("loaded %s from %s (%d files)", config.architecture, source, count)
    return model, config


def _read_weights(
    folder: str | Path, quantization: str | None, config: ModelConfig, device: torch.device
) -> tuple[dict[str, torch.Tensor], GgufFile | None, int]:
    """The checkpoint's HF-named tensors, the GGUF they came from (None for safetensors)
    and the number of files read."""
    folder = Path(folder)
    quantized = read_quantized_weights(folder, quantization, config, device)
    if quantized is not None:
        return quantized[0], quantized[1], 1
    weights, count = _read_safetensors(folder, device)
    return weights, None, count


def _read_safetensors(folder: Path, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """Every checkpoint tensor, read straight to `device`, and the number of files."""
    files = safetensors_files(folder)
    # safetensors cannot read to meta (tests' shapes-only device): read those on the CPU.
    read_to = "cpu" if device.type == "meta" else str(device)
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path), device=read_to))
    return weights, len(files)


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the index when present, else all of them."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} names weight files that are absent: {', '.join(missing)}; "
                "download the complete checkpoint"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {folder}; kvrelay loads safetensors checkpoints only "
            "(re-save .bin/.pt checkpoints with transformers' "
            "save_pretrained(safe_serialization=True))"
        )
    return files


def convert_hf_state_dict(
    hf: dict[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    source: str = "checkpoint",
) -> dict[str, torch.Tensor]:
    """Map HF names to `CausalLM`'s, fusing q/k/v and gate/up. Consumes `hf` (pops entries,
    so each original tensor is freed as soon as its fused copy exists)."""
    for name in [n for n in hf if n.endswith(_IGNORED_SUFFIXES)]:
        del hf[name]

    def take(name: str) -> torch.Tensor:
        try:
            weight = hf.pop(name)
        except KeyError:
            raise MissingWeightError(
                f"{source}: weight {name!r} is missing; the checkpoint does not match its "
                "config.json (re-download or re-convert it)"
            ) from None
        # uint8 holds raw quantized rows (the GGUF path): fused byte-wise, never converted.
        return weight if weight.dtype == torch.uint8 else weight.to(dtype)

    state: dict[str, torch.Tensor] = {"embed_tokens.weight": take("model.embed_tokens.weight")}
    for i in range(config.num_hidden_layers):
        _convert_layer(take, state, config, f"model.layers.{i}.", f"layers.{i}.")
    state["norm.weight"] = take("model.norm.weight")
    if config.tie_word_embeddings:
        # Some exports save the tied head too; it is the embedding, so drop the copy.
        hf.pop("lm_head.weight", None)
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    if hf:
        names = sorted(hf)
        raise ValueError(
            f"{source}: {len(names)} weights have no place in a {config.architecture} with this "
            f"config.json, e.g. {', '.join(names[:5])}; check that config.json (attention_bias, "
            "num_hidden_layers, architectures) matches the weights"
        )
    return state


def _layer_norm_names(config: ModelConfig) -> list[str]:
    """The per-layer norms of the family, HF's names and kvrelay's alike."""
    names = ["input_layernorm", "post_attention_layernorm"]
    if config.is_gemma:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if has_qk_norm(config):
        names += ["self_attn.q_norm", "self_attn.k_norm"]
    return names


def _convert_layer(
    take: Callable[[str], torch.Tensor],
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    hf_prefix: str,
    prefix: str,
) -> None:
    """One layer's weights into `state`, q/k/v and gate/up fused as kvrelay keeps them."""
    attn, mlp = hf_prefix + "self_attn.", hf_prefix + "mlp."
    for norm in _layer_norm_names(config):
        state[f"{prefix}{norm}.weight"] = take(f"{hf_prefix}{norm}.weight")
    if config.architecture in FUSED_CHECKPOINT_ARCHITECTURES:  # already q, k, v / gate, up
        qkv, gate_up = take(attn + "qkv_proj.weight"), take(mlp + "gate_up_proj.weight")
    else:
        qkv = torch.cat([take(f"{attn}{p}_proj.weight") for p in "qkv"])
        gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
    state[prefix + "self_attn.qkv_proj.weight"] = qkv  # [(heads + 2 * kv_heads) * head_dim, hidden]
    if config.attention_bias:
        state[prefix + "self_attn.qkv_proj.bias"] = torch.cat(
            [take(f"{attn}{p}_proj.bias") for p in "qkv"]
        )
    state[prefix + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
    if has_o_proj_bias(config):
        state[prefix + "self_attn.o_proj.bias"] = take(attn + "o_proj.bias")
    state[prefix + "mlp.gate_up_proj.weight"] = gate_up  # [2 * intermediate, hidden]
    state[prefix + "mlp.down_proj.weight"] = take(mlp + "down_proj.weight")
