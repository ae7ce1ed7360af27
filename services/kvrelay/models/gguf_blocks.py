"""GGUF Q4_1 and Q8_0 blocks: their bytes split into codes and constants, and their exact
dequantization. No kernels here (`kvrelay.models.quantized` holds the layers).

GGUF Q4_1 stores each run of 32 weights along a row as one block of 20 bytes: `d` (fp16),
`m` (fp16), then 16 bytes of 4-bit codes `q` (byte j: element j in its low nibble, element
j + 16 in its high nibble); the weight is `d * q + m`.

GGUF Q8_0 blocks are 34 bytes: `d` (fp16) then 32 int8 codes `q`; the weight is `d * q`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QUANT_BLOCK = 32  # weights per block in both formats (and the int4 kernel's group size)
Q4_1_BLOCK = QUANT_BLOCK
Q4_1_BLOCK_BYTES = 20  # d and m (fp16 each), then 32 4-bit codes
Q8_0_BLOCK_BYTES = 34  # d (fp16), then 32 int8 codes
_FORMATS = {Q4_1_BLOCK_BYTES: "Q4_1", Q8_0_BLOCK_BYTES: "Q8_0"}


class GgufBlocks(NamedTuple):
    """A weight as its GGUF blocks, for the block kernel: Q4_1 when `m` is given, else Q8_0."""

    codes: torch.Tensor  # Q4_1: [out, in / 2] uint8 (16 bytes a block); Q8_0: [out, in] int8
    d: torch.Tensor  # [out, in / 32] fp32 scales
    m: torch.Tensor | None  # Q4_1: [out, in / 32] fp32 offsets


class QuantizedWeightError(ValueError):
    """Quantized weight bytes that do not describe a tensor of the expected shape."""


def _blocks(raw: torch.Tensor, in_features: int, name: str, block_bytes: int) -> torch.Tensor:
    """`[out, in / 32, block_bytes]` view of rows of `name` blocks, after checking the shape."""
    blocks = in_features // QUANT_BLOCK
    if (
        raw.dtype != torch.uint8
        or raw.dim() != 2
        or in_features % QUANT_BLOCK
        or raw.shape[1] != blocks * block_bytes
    ):
        raise QuantizedWeightError(
            f"{name} data of shape {tuple(raw.shape)} ({raw.dtype}) does not hold rows of "
            f"{in_features} weights ({blocks} blocks of {block_bytes} bytes); the GGUF does "
            "not match config.json"
        )
    return raw.reshape(raw.shape[0], blocks, block_bytes)


def _fp16_field(cells: torch.Tensor, offset: int, name: str) -> torch.Tensor:
    """`[out, blocks]` fp32 of the fp16 at `offset` of every block, all finite."""
    rows, blocks = cells.shape[:2]
    value = cells[..., offset : offset + 2].contiguous().view(torch.float16)
    value = value.reshape(rows, blocks).float()
    bad = (~torch.isfinite(value)).nonzero()
    if len(bad):
        row, block = bad[0].tolist()
        raise QuantizedWeightError(
            f"{name} block {block} of row {row} has a non-finite scale ({value[row, block]}) "
            f"({len(bad)} such blocks); the GGUF is corrupt, re-download or re-convert it"
        )
    return value


def q4_1_fields(raw: torch.Tensor, in_features: int) -> tuple[torch.Tensor, ...]:
    """Split Q4_1 rows into codes and block constants.

    Args:
        raw: `[out, in / 32 * 20]` uint8, one row of blocks per output row.
        in_features: the row length in weights (a multiple of 32).

    Returns:
        `(q, d, m)`: `q` `[out, in]` int32 codes in 0..15; `d`, `m` `[out, in / 32]` fp32.

    Raises:
        QuantizedWeightError: `raw` is not `[out, in / 32 * 20]` uint8, or a constant is
            not finite.
    """
    codes, d, m = q4_1_blocks(raw, in_features)
    assert m is not None
    return q4_1_codes(codes, in_features), d, m


def q4_1_blocks(raw: torch.Tensor, in_features: int) -> GgufBlocks:
    """Q4_1 rows as `GgufBlocks` (the codes as stored, 16 bytes a block); raises as
    `q4_1_fields` does."""
    cells = _blocks(raw, in_features, "Q4_1", Q4_1_BLOCK_BYTES)
    d, m = _fp16_field(cells, 0, "Q4_1"), _fp16_field(cells, 2, "Q4_1")
    codes = cells[..., 4:].reshape(raw.shape[0], in_features // 2).contiguous()
    return GgufBlocks(codes, d, m)


def q4_1_codes(codes: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[out, in]` int32 codes in element order from `[out, in / 2]` stored bytes."""
    cells = codes.reshape(codes.shape[0], -1, Q4_1_BLOCK // 2)  # [out, blocks, 16]
    q = torch.cat((cells & 0x0F, cells >> 4), dim=-1)  # [out, blocks, 32] in element order
    return q.reshape(codes.shape[0], in_features).to(torch.int32)


def q8_0_fields(raw: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split Q8_0 rows into codes and block scales.

    Args:
        raw: `[out, in / 32 * 34]` uint8, one row of blocks per output row.
        in_features: the row length in weights (a multiple of 32).

    Returns:
        `(q, d)`: `q` `[out, in]` int32 codes in -128..127; `d` `[out, in / 32]` fp32.

    Raises:
        QuantizedWeightError: `raw` is not `[out, in / 32 * 34]` uint8, or a scale is not
            finite.
    """
    codes, d, _ = q8_0_blocks(raw, in_features)
    return codes.to(torch.int32), d


def q8_0_blocks(raw: torch.Tensor, in_features: int) -> GgufBlocks:
    """Q8_0 rows as `GgufBlocks` (`[out, in]` int8 codes); raises as `q8_0_fields` does."""
    cells = _blocks(raw, in_features, "Q8_0", Q8_0_BLOCK_BYTES)
    d = _fp16_field(cells, 0, "Q8_0")
    q = cells[..., 2:].contiguous().view(torch.int8)  # [out, blocks, 32]
    return GgufBlocks(q.reshape(raw.shape[0], in_features), d, None)


def dequantize_q4_1(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[out, in]` fp32 weights of Q4_1 rows: `d * q + m` per block (exact in fp32)."""
    q, d, m = q4_1_fields(raw, in_features)
    rows = q.shape[0]
    w = q.float().reshape(rows, -1, QUANT_BLOCK) * d[..., None] + m[..., None]
    return w.reshape(rows, in_features)


def dequantize_q8_0(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[out, in]` fp32 weights of Q8_0 rows: `d * q` per block (exact in fp32)."""
    q, d = q8_0_fields(raw, in_features)
    rows = q.shape[0]
    return (q.float().reshape(rows, -1, QUANT_BLOCK) * d[..., None]).reshape(rows, in_features)


def raw_format(raw: torch.Tensor, in_features: int) -> str:
    """ "Q4_1" or "Q8_0": which format raw rows of `in_features` weights are, by their width.

    Raises:
        QuantizedWeightError: the width is neither format's.
    """
    blocks = in_features // QUANT_BLOCK
    block_bytes = raw.shape[-1] // blocks if blocks and raw.shape[-1] % blocks == 0 else 0
    if in_features % QUANT_BLOCK or block_bytes not in _FORMATS:
        raise QuantizedWeightError(
            f"raw rows of {raw.shape[-1]} bytes hold {in_features} weights in neither Q4_1 "
            f"({Q4_1_BLOCK_BYTES} bytes per {QUANT_BLOCK}) nor Q8_0 ({Q8_0_BLOCK_BYTES}); "
            "the GGUF does not match config.json"
        )
    return _FORMATS[block_bytes]


def dequantize(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[out, in]` fp32 weights of raw Q4_1 or Q8_0 rows (see `raw_format`)."""
    if raw_format(raw, in_features) == "Q8_0":
        return dequantize_q8_0(raw, in_features)
    return dequantize_q4_1(raw, in_features)
