"""`--quantization`: read a model folder's GGUF with its Q4_1 matmul weights kept 4-bit.

The loader maps names and fuses q/k/v and gate/up as for safetensors (the raw Q4_1 rows are
fused byte-wise); this module finds the GGUF, reads it, and swaps the fused linears for
`Int4Linear`s before the rest of the state is loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from kvrelay.config import ModelConfig
from kvrelay.models.gguf_convert import read_gguf_weights
from kvrelay.models.layers import Linear
from kvrelay.models.quantized import (
    Q4_1_BLOCK,
    Q4_1_BLOCK_BYTES,
    Int4Linear,
    dequantize_q4_1,
    int4_kernel_fits,
)

logger = logging.getLogger(__name__)

# What `--quantization` accepts. "none": the safetensors weights as they are.
QUANTIZATIONS = ("none", "auto", "q4_1")
# The GGUF next to the default model's converted weights (models/default_model.py).
_PREFERRED_GGUF = "source.gguf"
_KEPT_TYPES = frozenset({"Q4_1"})


class QuantizationError(ValueError):
    """A `--quantization` that cannot be served from this model folder on this device."""


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


def read_quantized_weights(
    folder: Path, quantization: str | None, config: ModelConfig, device: torch.device
) -> tuple[dict[str, torch.Tensor], Path] | None:
    """The folder GGUF's weights under HF names, Q4_1 ones as raw uint8 rows and the rest
    fp32, and the GGUF's path; None when the safetensors weights are to be loaded.

    Raises:
        QuantizationError: an unknown value; "q4_1" on a non-CPU device or for a folder
            without a GGUF holding Q4_1 weights.
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
    gguf = find_gguf(folder)
    weights = (
        read_gguf_weights(gguf, config.num_attention_heads, config.num_key_value_heads, _KEPT_TYPES)
        if gguf is not None
        else {}
    )
    if any(w.dtype == torch.uint8 for w in weights.values()):
        assert gguf is not None
        return weights, gguf
    if auto:
        return None
    raise QuantizationError(
        f"quantization {quantization!r} reads Q4_1 weights from a GGUF in the model folder, "
        f"and {folder} has {'none' if gguf is None else f'no Q4_1 tensor in {gguf.name}'}; "
        "the default model keeps its source GGUF there (`kvrelay pull`)"
    )


def install_quantized_linears(
    model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> int:
    """Replace each linear whose weight in `state` is raw Q4_1 (uint8) by an `Int4Linear`.

    The replaced layers' weight (and bias) entries are taken out of `state`. A Q4_1 tensor
    that is not a linear's weight, or whose shape the int4 kernel does not take, is
    dequantized into `state` instead (exactly, in fp32, then cast to `dtype`).

    Returns:
        How many layers were replaced.
    """
    replaced = 0
    for key in [k for k, v in state.items() if v.dtype == torch.uint8]:
        path = key.removesuffix(".weight")
        module = model.get_submodule(path) if key.endswith(".weight") else None
        raw = state.pop(key)
        if not isinstance(module, Linear) or not int4_kernel_fits(
            module.out_features, module.in_features
        ):
            in_features = module.in_features if isinstance(module, Linear) else _row_length(raw)
            state[key] = dequantize_q4_1(raw, in_features).to(dtype)
            continue
        bias = state.pop(path + ".bias", None)
        parent_path, _, child = path.rpartition(".")
        quantized = Int4Linear(raw, module.in_features, bias, dtype)
        setattr(model.get_submodule(parent_path), child, quantized)
        replaced += 1
    if replaced:
        logger.info("%d linear layers run on Q4_1 weights (int4, %s activations)", replaced, dtype)
    return replaced


def _row_length(raw: torch.Tensor) -> int:
    """Weights per row of raw Q4_1 rows (20 bytes per 32 weights)."""
    return raw.shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK
