"""Random weights quantized by gguf's own code, for the CPU block kernels' tests."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kvrelay.models.gguf_blocks import (
    GgufBlocks,
    dequantize_q4_1,
    dequantize_q8_0,
    q4_1_blocks,
    q8_0_blocks,
)

FORMATS = {
    "q4_1": (GGMLQuantizationType.Q4_1, q4_1_blocks, dequantize_q4_1),
    "q8_0": (GGMLQuantizationType.Q8_0, q8_0_blocks, dequantize_q8_0),
}


def gguf_weight(fmt: str, out: int, inp: int, seed: int) -> tuple[GgufBlocks, torch.Tensor]:
    """gguf's own quantization (`fmt`: q4_1 or q8_0) of a random `[out, inp]` weight: its
    blocks and its exact fp32 dequantization."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((out, inp)) * 0.05 + rng.standard_normal((out, 1)) * 0.02
    kind, blocks_of, dequantize = FORMATS[fmt]
    raw = torch.from_numpy(np.array(quants.quantize(dense.astype(np.float32), kind)))
    return blocks_of(raw, inp), dequantize(raw, inp)
