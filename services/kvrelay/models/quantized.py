"""Weight-only quantized linear layers: GGUF Q4_1 and Q8_0 blocks kept as 4-/8-bit codes, run
by torch's packed int4 CPU matmul (`_weight_int4pack_mm_for_cpu`).

GGUF Q4_1 stores each run of 32 weights along a row as one block of 20 bytes: `d` (fp16),
`m` (fp16), then 16 bytes of 4-bit codes `q` (byte j: element j in its low nibble, element
j + 16 in its high nibble); the weight is `d * q + m`. torch's int4 kernel reads codes per
group along K with `(q - 8) * scale + zero`, so the same weight is `scale = d`,
`zero = m + 8 * d`: one group per block, no rounding of the codes.

GGUF Q8_0 blocks are 34 bytes: `d` (fp16) then 32 int8 codes `q`; the weight is `d * q`.
torch's int8 kernel (`_weight_int8pack_mm`) takes one scale per output row, which cannot hold
per-block scales, so Q8_0 runs as two int4 planes over the same groups: with
`u = q + 128 = 16 h + l` (h, l in 0..15), plane h has `scale = 16 d, zero = 0` and plane l
`scale = d, zero = 8 d`, and `(h - 8) 16 d + (l - 8) d + 8 d = d (16 h + l - 128) = d q`.
The layer reads 8 bits per weight; no code is rounded. The planes sit side by side along K
in one packed weight and the input is repeated to match, so one int4 matmul sums both: in
bf16 that rounds once, where two calls summed rounded three times (about 1.5x the error of
a bf16 dense matmul, and 10-30% slower at 1 row; `benchmarks/quantized_decode.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

QUANT_BLOCK = 32  # weights per block in both formats (and the int4 kernel's group size)
Q4_1_BLOCK = QUANT_BLOCK
Q4_1_BLOCK_BYTES = 20  # d and m (fp16 each), then 32 4-bit codes
Q8_0_BLOCK_BYTES = 34  # d (fp16), then 32 int8 codes
_FORMATS = {Q4_1_BLOCK_BYTES: "Q4_1", Q8_0_BLOCK_BYTES: "Q8_0"}
# torch's int4 packing requires the output rows in multiples of 16.
_INT4_ROW_MULTIPLE = 16
_INT4_ZERO_CODE = 8  # torch's kernel subtracts this from every code
_Q8_0_OFFSET = 128  # int8 code + 128 = unsigned 0..255, split into two nibbles

# One int4 plane: `[out, in]` int32 codes in 0..15, and `[out, in / 32]` fp32 scales, zeros.
Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
    cells = _blocks(raw, in_features, "Q4_1", Q4_1_BLOCK_BYTES)
    d, m = _fp16_field(cells, 0, "Q4_1"), _fp16_field(cells, 2, "Q4_1")
    codes = cells[..., 4:]  # [out, blocks, 16]
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1)  # [out, blocks, 32] in element order
    return q.reshape(raw.shape[0], in_features).to(torch.int32), d, m


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
    cells = _blocks(raw, in_features, "Q8_0", Q8_0_BLOCK_BYTES)
    d = _fp16_field(cells, 0, "Q8_0")
    q = cells[..., 2:].contiguous().view(torch.int8)  # [out, blocks, 32]
    return q.reshape(raw.shape[0], in_features).to(torch.int32), d


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


def int4_kernel_fits(out_features: int, in_features: int) -> bool:
    """Whether torch's packed int4 CPU kernel takes a `[out, in]` weight in 32-weight groups."""
    return out_features % _INT4_ROW_MULTIPLE == 0 and in_features % QUANT_BLOCK == 0


class Int4PlanesLinear(nn.Module):
    """A linear layer whose weight is a sum of int4 planes packed for torch's int4 CPU matmul
    (inference only); `Int4Linear` (Q4_1, one plane) and `Q8_0Linear` (two) build it.

    Activations are computed in `compute_dtype` (the model's dtype); the output is in the
    input's dtype. bf16 is the fast path: torch's int4 kernel is vectorized for bf16 (and
    about 20x slower in fp32, which is kept for checking against the dequantized model).
    Scales and zeros are held in `compute_dtype`: in bf16 that rounds them (fp16 in the file)
    to bf16's 8-bit mantissa, the one error besides summation order. The packed codes are
    buffers outside the state dict: the layer is built from a GGUF, never saved.
    """

    packed_weight: torch.Tensor  # torch's int4 packing of the planes side by side along K
    scales_and_zeros: torch.Tensor  # [planes * in / 32, out, 2]
    bias: torch.Tensor | None

    def __init__(
        self,
        planes: Sequence[Plane],
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        label: str,
    ) -> None:
        """Args:
        planes: one or more `(codes, scales, zeros)`, all of the same `[out, in]`; the
            weight is their sum.
        bias: `[out]` or None, added in `compute_dtype`.
        compute_dtype: the activations' dtype inside the matmul.
        label: the source format, for `repr`.

        Raises:
            QuantizedWeightError: the shape does not fit the int4 kernel.
        """
        super().__init__()
        self.out_features, self.in_features = planes[0][0].shape
        self.planes = len(planes)
        if not int4_kernel_fits(self.out_features, self.in_features):
            raise QuantizedWeightError(
                f"a [{self.out_features}, {self.in_features}] weight does not fit torch's "
                f"int4 kernel (rows a multiple of {_INT4_ROW_MULTIPLE}); load this model "
                "without --quantization"
            )
        self.compute_dtype, self.label = compute_dtype, label
        codes = torch.cat([q for q, _, _ in planes], dim=1)  # [out, planes * in]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        # [planes * in / 32, out, 2]: per group and output row, (scale, zero) as the kernel
        # takes them.
        scales_zeros = torch.cat([torch.stack((s.t(), z.t()), dim=-1) for _, s, z in planes])
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "scales_and_zeros", scales_zeros.to(compute_dtype).contiguous(), persistent=False
        )
        self.register_buffer(
            "bias", bias.to(compute_dtype) if bias is not None else None, persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out]
        x_c = x.to(self.compute_dtype)
        if self.planes > 1:
            x_c = x_c.repeat(1, self.planes)  # [M, planes * in]: each plane sees the input
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x_c, self.packed_weight, QUANT_BLOCK, self.scales_and_zeros
        )
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.label}, compute={self.compute_dtype}"
        )


class Int4Linear(Int4PlanesLinear):
    """Q4_1 rows as one int4 plane: `scale = d`, `zero = m + 8 d`."""

    def __init__(
        self,
        raw_q4_1: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
    ) -> None:
        """Args:
        raw_q4_1: `[out, in / 32 * 20]` uint8 Q4_1 rows (see `q4_1_fields`).
        in_features, bias, compute_dtype: as for `Int4PlanesLinear`.

        Raises:
            QuantizedWeightError: the bytes are not Q4_1 rows of that length, or the shape
                does not fit the int4 kernel (see `int4_kernel_fits`).
        """
        q, d, m = q4_1_fields(raw_q4_1, in_features)
        super().__init__([(q, d, m + _INT4_ZERO_CODE * d)], bias, compute_dtype, "q4_1")


class Q8_0Linear(Int4PlanesLinear):
    """Q8_0 rows as two int4 planes (high and low nibble of `q + 128`; see the module doc)."""

    def __init__(
        self,
        raw_q8_0: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
    ) -> None:
        """Args:
        raw_q8_0: `[out, in / 32 * 34]` uint8 Q8_0 rows (see `q8_0_fields`).
        in_features, bias, compute_dtype: as for `Int4PlanesLinear`.

        Raises:
            QuantizedWeightError: the bytes are not Q8_0 rows of that length, or the shape
                does not fit the int4 kernel (see `int4_kernel_fits`).
        """
        q, d = q8_0_fields(raw_q8_0, in_features)
        u = q + _Q8_0_OFFSET
        high = (u >> 4, 16 * d, torch.zeros_like(d))
        low = (u & 0x0F, d, _INT4_ZERO_CODE * d)
        super().__init__([high, low], bias, compute_dtype, "q8_0")


def quantized_linear(
    raw: torch.Tensor, in_features: int, bias: torch.Tensor | None, compute_dtype: torch.dtype
) -> Int4PlanesLinear:
    """The layer for raw Q4_1 or Q8_0 rows (told apart by `raw_format`)."""
    if raw_format(raw, in_features) == "Q8_0":
        return Q8_0Linear(raw, in_features, bias, compute_dtype)
    return Int4Linear(raw, in_features, bias, compute_dtype)
