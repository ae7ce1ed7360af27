"""Convert a llama-architecture GGUF file into a plain Hugging Face folder (fp32 safetensors).

Dequantizes every tensor, undoes llama.cpp's q/k row permutation, and writes config.json,
generation_config.json, model.safetensors and the tokenizer (with its chat template).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file

from kvrelay.config import UnsupportedModelError

logger = logging.getLogger(__name__)

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> None:
    """Write the HF folder for `gguf_path` into the existing folder `out_dir`.

    Raises:
        UnsupportedModelError: the GGUF is not a llama-architecture model, or uses a feature
            this converter does not carry over (RoPE scaling other than linear, rope factors).
        ValueError: a tensor's name or shape does not fit the metadata.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensor_names = {t.name for t in reader.tensors}
    config = hf_config_from_gguf(fields, tensor_names)
    tensors = _convert_tensors(reader, config, progress)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors, reader
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(gguf_path, out_dir, fields, config["max_position_embeddings"])


def hf_config_from_gguf(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF `config.json` of a llama GGUF, from its metadata."""
    _check_supported(fields, tensor_names)

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}; the file is incomplete")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(fields.get("llama.attention.key_length") or hidden // heads)
    vocab = int(fields.get("llama.vocab_size") or len(fields["tokenizer.ggml.tokens"]))
    eos = int(fields["tokenizer.ggml.eos_token_id"])
    eos_ids = _eos_token_ids(fields, eos)
    rope_scaling = _rope_scaling(fields)
    bos = fields.get("tokenizer.ggml.bos_token_id")
    pad = fields.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        # GGUF stores these as float32; print them as the short decimal they were written from.
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": eos_ids,
        "pad_token_id": int(pad) if pad is not None else eos,
        "torch_dtype": "float32",
    }


def _check_supported(fields: dict[str, Any], tensor_names: set[str]) -> None:
    """Raise UnsupportedModelError unless the GGUF is a llama the converter carries over."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; the converter handles 'llama' "
            "(use a Hugging Face safetensors checkpoint instead)"
        )
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "this GGUF carries llama3 rope factors (rope_freqs.weight), which the converter "
            "does not map; use the model's Hugging Face safetensors checkpoint instead"
        )


def _eos_token_ids(fields: dict[str, Any], eos: int) -> list[int]:
    """The tokenizer's eos, then <|endoftext|> when that is a different token.

    A chat turn of the instruct model ends with its eos (<|im_end|>); a document ends with
    <|endoftext|>. Stopping on both keeps raw (non-chat) completions from running past it.
    """
    eos_ids = [eos]
    tokens = fields.get("tokenizer.ggml.tokens") or []
    if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") != eos:
        eos_ids.append(tokens.index("<|endoftext|>"))
    return eos_ids


def _rope_scaling(fields: dict[str, Any]) -> dict[str, Any] | None:
    """HF's `rope_scaling` for GGUF linear scaling (None without scaling); others raise."""
    scaling_type = fields.get("llama.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type != "linear":
        raise UnsupportedModelError(
            f"GGUF rope scaling {scaling_type!r} is not supported by the converter (linear only)"
        )
    factor = fields.get("llama.rope.scaling.factor")
    if factor is None:
        raise ValueError("GGUF metadata lacks llama.rope.scaling.factor; the file is incomplete")
    return {"rope_type": "linear", "factor": float(factor)}


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from HF's "rotate half" layout (all first
    halves, then all second halves) to interleaved pairs (its rope kernel rotates adjacent
    elements): HF row `h*D + i*D/2 + j` becomes GGUF row `h*D + 2*j + i`. This is the inverse.
    Works for weights `[rows, hidden]` and biases `[rows]`.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [heads, D/2 (j), 2 (i), ...] -> [heads, 2 (i), D/2 (j), ...]
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
    return w.reshape(weight.shape).contiguous()


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.

    Raises:
        ValueError: a tensor this converter has no HF name for.
    """
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")


def _convert_tensors(
    reader: Any, config: dict[str, Any], progress: bool
) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for tensor in tqdm(
        reader.tensors, desc="converting GGUF tensors", unit="tensor", disable=not progress
    ):
        name = hf_tensor_name(tensor.name)
        out[name] = _hf_tensor(tensor, name, heads, kv_heads, keep_quantized=frozenset())
    _check_shapes(out, config)
    return out


class GgufFile(NamedTuple):
    """A GGUF file's path and its tensor entries (their data memory-mapped, read on use)."""

    path: Path
    tensors: list[Any]


def open_gguf(gguf_path: str | Path) -> GgufFile:
    """Parse the GGUF's header once. The parse walks every metadata entry, the vocabulary's
    tokens included (5.8 s for the default model's 49k on a 2-core EPYC): a load that asks
    the file several things (its types, its weights, one raw tensor) asks one `GgufFile`."""
    from gguf import GGUFReader

    path = Path(gguf_path)
    return GgufFile(path, list(GGUFReader(path).tensors))


def read_gguf_weights(
    gguf: GgufFile, num_heads: int, num_kv_heads: int, keep_quantized: frozenset[str]
) -> dict[str, torch.Tensor]:
    """The GGUF's weights under their Hugging Face names, q/k rows in HF's order.

    Tensors whose GGUF type is named in `keep_quantized` (e.g. "Q4_1") stay as their raw
    blocks, `[rows, bytes per row]` uint8; every other tensor is dequantized to fp32.
    """
    out: dict[str, torch.Tensor] = {}
    for tensor in gguf.tensors:
        name = hf_tensor_name(tensor.name)
        out[name] = _hf_tensor(tensor, name, num_heads, num_kv_heads, keep_quantized)
    return out


def read_raw_gguf_tensor(
    gguf: GgufFile, gguf_name: str, types: frozenset[str]
) -> torch.Tensor | None:
    """The raw blocks (`[rows, bytes per row]` uint8) of the GGUF tensor `gguf_name`, if it
    is there and of one of `types`; else None."""
    for tensor in gguf.tensors:
        if tensor.name == gguf_name and tensor.tensor_type.name in types:
            return torch.from_numpy(np.array(tensor.data, np.uint8))
    return None


def _hf_tensor(
    tensor: Any, name: str, heads: int, kv_heads: int, keep_quantized: frozenset[str]
) -> torch.Tensor:
    """One GGUF tensor in HF's orientation (`[out, in]`) and row order."""
    from gguf.quants import dequantize

    # np.array copies, so the result owns its memory instead of pointing into the GGUF
    # file's read-only memory map.
    if tensor.tensor_type.name in keep_quantized:
        weight = torch.from_numpy(np.array(tensor.data, np.uint8))  # [out, bytes per row]
    else:
        # dequantize gives the HF orientation ([out, in]).
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32))
    # The permutation moves whole rows, so it applies to raw quantized rows as well.
    if ".q_proj." in name:
        weight = unpermute_rotary(weight, heads)
    elif ".k_proj." in name:
        weight = unpermute_rotary(weight, kv_heads)
    return weight


def _check_shapes(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    hidden, d = config["hidden_size"], config["head_dim"]
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.layers.0.self_attn.q_proj.weight": (config["num_attention_heads"] * d, hidden),
        "model.layers.0.self_attn.k_proj.weight": (config["num_key_value_heads"] * d, hidden),
        "model.layers.0.mlp.gate_proj.weight": (config["intermediate_size"], hidden),
    }
    for name, shape in expected.items():
        got = tuple(tensors[name].shape) if name in tensors else None
        if got != shape:
            raise ValueError(
                f"GGUF tensor for {name} has shape {got}, metadata implies {shape}; "
                "the file is inconsistent"
            )


def _save_tokenizer(
    gguf_path: Path, out_dir: Path, fields: dict[str, Any], max_length: int
) -> None:
    # transformers builds a fast tokenizer from the GGUF vocabulary and merges.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    template = fields.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out_dir))


def _f32(value: float) -> float:
    return float(str(np.float32(value)))
