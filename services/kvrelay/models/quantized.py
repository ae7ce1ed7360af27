"""Weight-only quantized linear layers: GGUF Q4_1 blocks kept as 4-bit codes, run by torch's
packed int4 CPU matmul (`_weight_int4pack_mm_for_cpu`).

GGUF Q4_1 stores each run of 32 weights along a row as one block of 20 bytes: `d` (fp16),
`m` (fp16), then 16 bytes of 4-bit codes `q` (byte j: element j in its low nibble, element
j + 16 in its high nibble); the weight is `d * q + m`. torch's int4 kernel reads codes per
group along K with `(q - 8) * scale + zero`, so the same weight is `scale = d`,
`zero = m + 8 * d`: one group per block, no rounding of the codes.
"""

from __future__ import annotations

import torch
from torch import nn

Q4_1_BLOCK = 32  # weights per block (and the int4 kernel's group size)
Q4_1_BLOCK_BYTES = 20  # d and m (fp16 each), then 32 4-bit codes
# torch's int4 packing requires the output rows in multiples of 16.
_INT4_ROW_MULTIPLE = 16
_INT4_ZERO_CODE = 8  # torch's kernel subtracts this from every code


class QuantizedWeightError(ValueError):
    """Quantized weight bytes that do not describe a tensor of the expected shape."""


def q4_1_fields(raw: torch.Tensor, in_features: int) -> tuple[torch.Tensor, ...]:
    """Split Q4_1 rows into codes and block constants.

    Args:
        raw: `[out, in / 32 * 20]` uint8, one row of blocks per output row.
        in_features: the row length in weights (a multiple of 32).

    Returns:
        `(q, d, m)`: `q` `[out, in]` int32 codes in 0..15; `d`, `m` `[out, in / 32]` fp32.

    Raises:
        QuantizedWeightError: `raw` is not `[out, in / 32 * 20]` uint8.
    """
    blocks = in_features // Q4_1_BLOCK
    if (
        raw.dtype != torch.uint8
        or raw.dim() != 2
        or in_features % Q4_1_BLOCK
        or raw.shape[1] != blocks * Q4_1_BLOCK_BYTES
    ):
        raise QuantizedWeightError(
            f"Q4_1 data of shape {tuple(raw.shape)} ({raw.dtype}) does not hold rows of "
            f"{in_features} weights ({in_features // Q4_1_BLOCK} blocks of "
            f"{Q4_1_BLOCK_BYTES} bytes); the GGUF does not match config.json"
        )
    rows = raw.shape[0]
    cells = raw.reshape(rows, blocks, Q4_1_BLOCK_BYTES)
    d = cells[..., 0:2].contiguous().view(torch.float16).reshape(rows, blocks).float()
    m = cells[..., 2:4].contiguous().view(torch.float16).reshape(rows, blocks).float()
    codes = cells[..., 4:]  # [out, blocks, 16]
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1)  # [out, blocks, 32] in element order
    return q.reshape(rows, in_features).to(torch.int32), d, m


def dequantize_q4_1(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[out, in]` fp32 weights of Q4_1 rows: `d * q + m` per block (exact in fp32)."""
    q, d, m = q4_1_fields(raw, in_features)
    rows = q.shape[0]
    w = q.float().reshape(rows, -1, Q4_1_BLOCK) * d[..., None] + m[..., None]
    return w.reshape(rows, in_features)


def int4_kernel_fits(out_features: int, in_features: int) -> bool:
    """Whether torch's packed int4 CPU kernel takes a `[out, in]` weight in Q4_1 groups."""
    return out_features % _INT4_ROW_MULTIPLE == 0 and in_features % Q4_1_BLOCK == 0


class Int4Linear(nn.Module):
    """A linear layer over Q4_1 weights packed for torch's int4 CPU matmul (inference only).

    Activations are computed in `compute_dtype` (the model's dtype); the output is in the
    input's dtype. bf16 is the fast path: torch's int4 kernel is vectorized for bf16 (and
    about 20x slower in fp32, which is kept for checking against the dequantized model).
    Scales and zeros are held in `compute_dtype`: in bf16 that rounds `d` and `m + 8d`
    (fp16 in the file) to bf16's 8-bit mantissa, the one error besides summation order.
    The packed codes are buffers outside the state dict: the layer is built from a GGUF,
    never saved.
    """

    def __init__(
        self,
        raw_q4_1: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
    ) -> None:
        """Args:
        raw_q4_1: `[out, in / 32 * 20]` uint8 Q4_1 rows (see `q4_1_fields`).
        in_features: the row length in weights.
        bias: `[out]` or None, added in `compute_dtype`.
        compute_dtype: the activations' dtype inside the matmul.

        Raises:
            QuantizedWeightError: the bytes are not Q4_1 rows of that length, or the shape
                does not fit the int4 kernel (see `int4_kernel_fits`).
        """
        super().__init__()
        q, d, m = q4_1_fields(raw_q4_1, in_features)
        self.out_features, self.in_features = q.shape
        if not int4_kernel_fits(self.out_features, self.in_features):
            raise QuantizedWeightError(
                f"a [{self.out_features}, {self.in_features}] weight does not fit torch's "
                f"int4 kernel (rows a multiple of {_INT4_ROW_MULTIPLE}); load this model "
                "without --quantization"
            )
        self.compute_dtype = compute_dtype
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # [in / 32, out, 2]: per group and output row, (scale, zero) in the kernel's convention.
        scales_zeros = torch.stack((d.t(), m.t() + _INT4_ZERO_CODE * d.t()), dim=-1)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "scales_and_zeros", scales_zeros.to(compute_dtype).contiguous(), persistent=False
        )
        self.register_buffer(
            "bias", bias.to(compute_dtype) if bias is not None else None, persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.compute_dtype), self.packed_weight, Q4_1_BLOCK, self.scales_and_zeros
        )
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"q4_1, compute={self.compute_dtype}"
        )
