"""`--quantization`: read a model folder's GGUF with its Q4_1 or Q8_0 matmul weights kept
4-/8-bit.

The loader maps names and fuses q/k/v and gate/up as for safetensors (raw rows are fused
byte-wise); this module finds the GGUF, reads it, and swaps the fused linears for
`Int4PlanesLinear`s before the rest of the state is loaded.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kvrelay.config import ModelConfig
from kvrelay.models.families import GGUF_ARCHITECTURES
from kvrelay.models.gguf_blocks import dequantize
from kvrelay.models.gguf_convert import (
    GgufFile,
    hf_tensor_name,
    open_gguf,
    read_gguf_weights,
    read_raw_gguf_tensor,
)
from kvrelay.models.layers import Linear
from kvrelay.models.llama import ALL_ROWS, CausalLM
from kvrelay.models.quantized import (
    block_kernel,
    int4_kernel_fits,
    int8_dot_kernel,
    quantized_linear,
)

logger = logging.getLogger(__name__)

# What `--quantization` accepts. "none": the safetensors weights as they are.
QUANTIZATIONS = ("none", "auto", "q4_1", "q8_0")
# The GGUF next to the default model's converted weights (models/default_model.py).
_PREFERRED_GGUF = "source.gguf"
# The GGUF tensor types each choice keeps as raw rows ("auto": whichever of these the
# matmul weights are); every other tensor is dequantized to fp32 at load.
_KEPT_TYPES = {"q4_1": frozenset({"Q4_1"}), "q8_0": frozenset({"Q8_0"})}
_AUTO_TYPES = frozenset({"Q4_1", "Q8_0"})
# Weights the loader concatenates into one linear (q/k/v, gate/up): kept raw only together.
_FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 ("mlp.gate_proj", "mlp.up_proj"))  # fmt: skip


class QuantizationError(ValueError):
    """A `--quantization` that cannot be served from this model folder on this device."""


def check_int8_activations(quantization: str | None, int8_activations: bool) -> None:
    """Refuse int8 activations without quantized weights (they multiply GGUF blocks only).

    Raises:
        QuantizationError: `int8_activations` with no `quantization`, or where the int8
            kernel cannot run.
    """
    if not int8_activations:
        return
    if quantization in (None, "none"):
        raise QuantizationError(
            "int8 activations multiply GGUF-quantized weights: add --quantization q4_1, q8_0 "
            "or auto (the default model keeps its Q4_1 GGUF), or drop --int8-activations"
        )
    if int8_dot_kernel() is None:
        raise QuantizationError(
            "int8 activations need kvrelay's CPU block kernels, which are off "
            "(KVRELAY_CPU_QUANT_KERNEL=torch) or could not be built (is a C++ compiler "
            "installed?); drop --int8-activations"
        )


def find_gguf(folder: Path) -> Path | None:
    """The folder's GGUF: `source.gguf` when present, else its only *.gguf, else None.

    Raises:
        QuantizationError: several GGUF files and none named `source.gguf`.
    """
    preferred = folder / _PREFERRED_GGUF
    if preferred.is_file():
        return preferred
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise QuantizationError(
            f"{folder} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
            f"keep one, or name the one to serve {_PREFERRED_GGUF}"
        )
    return found[0] if found else None


def matmul_types(gguf: GgufFile) -> Counter[str]:
    """How many of the GGUF's matmul weights (attention and MLP projections) are of each
    tensor type, e.g. `{"Q4_1": 210}`."""
    return Counter(
        t.tensor_type.name for t in gguf.tensors if hf_tensor_name(t.name).endswith("_proj.weight")
    )


def read_quantized_weights(
    folder: Path, quantization: str | None, config: ModelConfig, device: torch.device
) -> tuple[dict[str, torch.Tensor], GgufFile] | None:
    """The folder GGUF's weights under HF names, the kept quantized ones as raw uint8 rows
    and the rest fp32, and the GGUF (`install_quantized_logits` asks it again); None when
    the safetensors weights are to be loaded.

    Raises:
        QuantizationError: an unknown value; "q4_1"/"q8_0" on a non-CPU device, for a family
            the GGUF tensors do not carry, or for a folder without a GGUF whose matmul
            weights include that type.
    """
    if quantization is None or quantization == "none":
        return None
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    auto = quantization == "auto"
    if device.type != "cpu":
        if auto:
            return None
        raise QuantizationError(
            f"quantization {quantization!r} runs on the CPU only (torch's int4 CPU kernel); "
            f"drop --quantization on {device.type}"
        )
    if config.architecture not in GGUF_ARCHITECTURES:
        if auto:
            return None  # the folder's safetensors
        raise QuantizationError(
            f"quantization {quantization!r} reads llama.cpp's llama tensors, which carry "
            f"{', '.join(GGUF_ARCHITECTURES)} only, not {config.architecture}; drop "
            "--quantization for this folder (its safetensors load as they are)"
        )
    path = find_gguf(folder)
    gguf = open_gguf(path) if path is not None else None
    found = matmul_types(gguf) if gguf is not None else Counter[str]()
    kept = (_AUTO_TYPES if auto else _KEPT_TYPES[quantization]) & found.keys()
    if not kept:
        if auto:
            return None
        raise QuantizationError(_no_such_weights(quantization, folder, gguf, found))
    assert gguf is not None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    weights = read_gguf_weights(gguf, heads, kv_heads, frozenset(kept))
    _dequantize_mixed_groups(weights, config)
    return weights, gguf


def _no_such_weights(
    quantization: str, folder: Path, gguf: GgufFile | None, found: Counter[str]
) -> str:
    wanted = quantization.upper()
    if gguf is None:
        what = "none"
    else:
        types = ", ".join(f"{n} {t}" for t, n in found.most_common()) or "none"
        what = f"no {wanted} matmul weight in {gguf.path.name} (its matmul weights: {types})"
        usable = sorted(_AUTO_TYPES & found.keys())
        if usable:
            what += f"; serve it with --quantization {usable[0].lower()}"
    return (
        f"quantization {quantization!r} reads {wanted} matmul weights from a GGUF in the model "
        f"folder, and {folder} has {what}; the default model keeps its Q4_1 source GGUF there "
        "(`kvrelay pull`)"
    )


def _dequantize_mixed_groups(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Dequantize (to fp32) the raw weights of any fused group whose members differ in
    format, e.g. Q8_0 q_proj beside Q4_1 k_proj: rows of different widths cannot be
    concatenated into one layer."""
    for i in range(config.num_hidden_layers):
        for group in _FUSED_GROUPS:
            names = [f"model.layers.{i}.{p}.weight" for p in group]
            members = [weights[n] for n in names if n in weights]
            if len({(m.dtype, m.shape[1]) for m in members}) <= 1:
                continue
            for name in names:
                if name in weights and weights[name].dtype == torch.uint8:
                    weights[name] = dequantize(weights[name], config.hidden_size)


def install_quantized_linears(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    int8_activations: bool = False,
) -> int:
    """Replace each linear whose weight in `state` is raw Q4_1 or Q8_0 (uint8) by an
    `Int4PlanesLinear` (with `int8_activations`, see there).

    The replaced layers' weight (and bias) entries are taken out of `state`. A raw tensor
    that is not a linear's weight (e.g. a Q8_0 token embedding), or whose shape the int4
    kernel does not take, is dequantized into `state` instead (exactly, in fp32, then cast
    to `dtype`).

    Returns:
        How many layers were replaced.
    """
    replaced: Counter[str] = Counter()
    for key in [k for k, v in state.items() if v.dtype == torch.uint8]:
        path = key.removesuffix(".weight")
        module = model.get_submodule(path) if key.endswith(".weight") else None
        raw = state.pop(key)
        if not isinstance(module, Linear) or not int4_kernel_fits(
            module.out_features, module.in_features
        ):
            in_features = model.get_parameter(key).shape[-1]
            state[key] = dequantize(raw, in_features).to(dtype)
            continue
        bias = state.pop(path + ".bias", None)
        parent_path, _, child = path.rpartition(".")
        quantized = quantized_linear(raw, module.in_features, bias, dtype, int8_activations)
        setattr(model.get_submodule(parent_path), child, quantized)
        replaced[quantized.label] += 1
    activations = "int8" if int8_activations else str(dtype)
    for label, count in replaced.items():
        logger.info("%d linear layers run on %s weights, %s activations", count, label, activations)
    return sum(replaced.values())


def install_quantized_logits(
    model: CausalLM, gguf: GgufFile, dtype: torch.dtype, int8_activations: bool = False
) -> bool:
    """Give a tied-embedding model's vocab projection the GGUF's own blocks of the token
    embedding (`model.quantized_logits`), for steps of few rows; whether it did.

    Only with fp32 activations or int8 ones, and the block kernel built: the embedding is
    dequantized for lookups (and oneDNN packs a copy for many rows), but one decode row
    reads all of that weight, 113 MB for the default model in fp32 against 30 MB of Q8_0
    blocks. On a 2-core AVX2 EPYC the projection took 4.0 instead of 10.3 ms at one row
    (two threads); in bf16, where the dense weight is half the bytes, the fp32 block loop
    was not worth a second copy (the int8 one is).
    """
    if model.lm_head is not None:
        return False
    if dtype != torch.float32 and not int8_activations:
        return False
    if block_kernel() is None:
        return False
    raw = read_raw_gguf_tensor(gguf, "token_embd.weight", _AUTO_TYPES)
    embedding = model.get_parameter("embed_tokens.weight")
    vocab, hidden = embedding.shape
    if raw is None or not int4_kernel_fits(vocab, hidden):
        return False
    layer = quantized_linear(raw, hidden, None, dtype, int8_activations)
    if not layer.blocks_for_few_rows:
        return False
    model.quantized_logits = layer
    if int8_activations:  # the int8 kernel beat oneDNN's packed bf16 at 16 rows too
        model.quantized_logits_below_rows = ALL_ROWS
    logger.info("the vocab projection of few rows runs on the GGUF's %s blocks", layer.label)
    return True
