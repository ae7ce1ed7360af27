"""Weight-only quantized linear layers: GGUF Q4_1 and Q8_0 blocks kept as 4-/8-bit codes, run
by torch's packed int4 CPU matmul (`_weight_int4pack_mm_for_cpu`).

The blocks (`kvrelay.models.gguf_blocks`): Q4_1's weight is `d * q + m` with 4-bit codes.
torch's int4 kernel reads codes per group along K with `(q - 8) * scale + zero`, so the same
weight is `scale = d`, `zero = m + 8 * d`: one group per block, no rounding of the codes.

Q8_0's weight is `d * q` with int8 codes. torch's int8 kernel (`_weight_int8pack_mm`) takes
one scale per output row, which cannot hold per-block scales, so Q8_0 runs as two int4 planes
over the same groups: with `u = q + 128 = 16 h + l` (h, l in 0..15), plane h has
`scale = 16 d, zero = 0` and plane l `scale = d, zero = 8 d`, and
`(h - 8) 16 d + (l - 8) d + 8 d = d (16 h + l - 128) = d q`.
The layer reads 8 bits per weight; no code is rounded. The planes sit side by side along K
in one packed weight and the input is repeated to match, so one int4 matmul sums both: in
bf16 that rounds once, where two calls summed rounded three times (about 1.5x the error of
a bf16 dense matmul, and 10-30% slower at 1 row; `benchmarks/quantized_decode.py`).

Where kvrelay's CPU extension builds, the layers also keep the GGUF blocks as they are (codes,
and the fp16 constants as fp32) for `kvrelay_kernels.cpu_quantized`: batches of many rows
(prefill) dequantize the layer and run the dense matmul, and few-row batches (Q8_0 always,
Q4_1 unless it computes in native bf16) run its loop, which dequantizes each block in
registers and sums in fp32 (exact weights: only the order of the sums differs from the
dequantized fp32 matmul). See `Int4PlanesLinear`.
`KVRELAY_CPU_QUANT_KERNEL=torch` runs torch's int4 kernel alone (for comparisons).

With `int8_activations` the layers hold the blocks repacked in panels of 16 rows instead
(`int8_panels`), and every batch, decode rows and prefill chunks alike, quantizes its
activations to int8 per 32 values (llama.cpp's scheme) and runs integer dot products
(`csrc_cpu/int8_dot_matmul.cpp`): faster, and NOT exact (opt-in, `--int8-activations`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.common.env import CPU_QUANT_KERNEL
from kvrelay.models.cpu_features import cpu_has_native_bf16
from kvrelay.models.gguf_blocks import (
    QUANT_BLOCK,
    GgufBlocks,
    QuantizedWeightError,
    q4_1_blocks,
    q4_1_codes,
    q8_0_blocks,
    raw_format,
)
from kvrelay.models.layers import NativeMatmul
from kvrelay_kernels.cpu_quantized import load_block_quant_ops, load_int8_dot_ops

# torch's int4 packing requires the output rows in multiples of 16.
_INT4_ROW_MULTIPLE = 16
_INT4_ZERO_CODE = 8  # torch's kernel subtracts this from every code
_Q8_0_OFFSET = 128  # int8 code + 128 = unsigned 0..255, split into two nibbles

# One int4 plane: `[out, in]` int32 codes in 0..15, and `[out, in / 32]` fp32 scales, zeros.
Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
QUANT_KERNEL_ENV = CPU_QUANT_KERNEL.name  # "auto" (ours where it builds) or "torch"
# From this many rows on, the few-row kernels' multiply-adds (torch's int4, the Q8_0 block
# loop) cost more than dequantizing the layer and running oneDNN's dense matmul
# (`benchmarks/quantized_decode.py --layers`: at 16 rows about even, at 64 rows 2-3x apart).
DENSE_FROM_ROWS = 32
DENSE_SLICE_ROWS = 4096  # output rows dequantized at a time for that (a few MB)
_PANEL_ROWS = 16  # output rows per panel of the int8 kernel


def block_kernel() -> ModuleType | None:
    """The CPU block kernel, unless `KVRELAY_CPU_QUANT_KERNEL=torch` or it cannot be built."""
    choice = CPU_QUANT_KERNEL.get()
    if choice not in ("auto", "torch"):
        raise ValueError(f"{QUANT_KERNEL_ENV}={choice!r}: expected 'auto' or 'torch'")
    return load_block_quant_ops() if choice == "auto" else None


def int8_dot_kernel() -> ModuleType | None:
    """The CPU int8-activation kernel (`int8_activations`), where the block kernel is used
    and it builds."""
    return load_int8_dot_ops() if block_kernel() is not None else None


def int8_panels(weight: GgufBlocks) -> GgufBlocks:
    """`weight`'s blocks repacked for the int8 kernel: panels of 16 rows (see
    csrc_cpu/int8_dot_matmul.cpp).

    Per panel and block, the blocks' 4-byte words of the 16 rows side by side: codes
    `[out / 16, blocks * words * 16 * 4]` uint8 (Q4_1: 4 words a block, Q8_0: 8, its codes'
    bits as they are), scales (and offsets) `[out / 16, blocks * 16]` fp16 (the file's own
    values, so the cast is exact).

    Raises:
        QuantizedWeightError: `out` is not a multiple of 16.
    """
    rows, blocks = weight.d.shape
    if rows % _PANEL_ROWS:
        raise QuantizedWeightError(
            f"{rows} output rows do not make panels of {_PANEL_ROWS}; load this model "
            "without --int8-activations"
        )
    panels = rows // _PANEL_ROWS

    def words(codes: torch.Tensor) -> torch.Tensor:
        cells = codes.view(torch.uint8).reshape(panels, _PANEL_ROWS, blocks, -1, 4)
        return cells.permute(0, 2, 3, 1, 4).reshape(panels, -1).contiguous()

    def scales(values: torch.Tensor) -> torch.Tensor:
        cells = values.half().reshape(panels, _PANEL_ROWS, blocks)
        return cells.transpose(1, 2).reshape(panels, -1).contiguous()

    offsets = scales(weight.m) if weight.m is not None else None
    return GgufBlocks(words(weight.codes), scales(weight.d), offsets)


def int4_kernel_fits(out_features: int, in_features: int) -> bool:
    """Whether torch's packed int4 CPU kernel takes a `[out, in]` weight in 32-weight groups."""
    return out_features % _INT4_ROW_MULTIPLE == 0 and in_features % QUANT_BLOCK == 0


class Int4PlanesLinear(nn.Module):
    """A linear layer over block-quantized weights (inference only); `Int4Linear` (Q4_1) and
    `Q8_0Linear` build it.

    Where kvrelay's CPU block kernel builds (`block_kernel()`), the layer keeps the weight's
    GGUF blocks, and from `DENSE_FROM_ROWS` rows on (a prefill chunk) dequantizes them to
    `compute_dtype` for the call and multiplies densely (oneDNN; 6-13x torch's int4 kernel
    at 512 rows). Fewer rows go through
    - the block kernel's own loop (Q8_0 always; Q4_1 unless `compute_dtype` is bf16 on a CPU
      that computes bf16 natively): exact weights, fp32 sums, the output rounded once. For
      Q8_0 as fast as torch's two int4 planes, with no second copy of the weight. For Q4_1
      in fp32 12-17x torch's int4 kernel (whose fp32 path is ~20x slower than its bf16 one),
      and on a 2-core AVX2 EPYC 1.5x torch's kernel in bf16 too (8 vs 5 G weights/s at one
      row; `benchmarks/quantized_decode.py --layers`).
    - otherwise torch's packed int4 CPU matmul over the sum of int4 planes (and both formats
      where the block kernel cannot build): activations in `compute_dtype`, scales and zeros
      held in `compute_dtype` (in bf16 that rounds them, fp16 in the file, to bf16's 8-bit
      mantissa: the one error besides summation order). With native bf16 it beat the loop
      on a 2-core Xeon (22 vs 14 G weights/s at one row); a Q4_1 layer then holds its codes
      twice (torch's packing and the blocks), ~1.1 bytes a weight.
    The codes are buffers outside the state dict: the layer is built from a GGUF, never saved.
    """

    bias: torch.Tensor | None
    codes: torch.Tensor  # the GgufBlocks fields, with the block kernel (as `int8_panels`
    d: torch.Tensor  # with int8 activations)
    m: torch.Tensor | None

    def __init__(
        self,
        planes: Callable[[], Sequence[Plane]],
        blocks: GgufBlocks,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        label: str,
        int8_activations: bool = False,
    ) -> None:
        """Args:
        planes: makes one or more `(codes, scales, zeros)`, all of the same `[out, in]`,
            whose sum is the weight (called only for torch's kernel).
        blocks: the same weight as GGUF blocks (for the block kernel).
        bias: `[out]` or None, added in `compute_dtype`.
        compute_dtype: the activations' dtype inside torch's matmul, and the dense
            weight's for many rows.
        label: the source format, for `repr`.
        int8_activations: inputs are quantized to int8 per 32 values and multiplied by
            integer dot products (`kvrelay_kernels.cpu_quantized.load_int8_dot_ops`), at
            every row count: faster, NOT exact (the activations are rounded to 8 bits).

        Raises:
            QuantizedWeightError: the shape does not fit torch's int4 kernel, or
                `int8_activations` where the int8 kernel cannot run.
        """
        super().__init__()
        rows, k = blocks.codes.shape
        self.out_features, self.in_features = rows, (k * 2 if blocks.m is not None else k)
        if not int4_kernel_fits(self.out_features, self.in_features):
            raise QuantizedWeightError(
                f"a [{self.out_features}, {self.in_features}] weight does not fit torch's "
                f"int4 kernel (rows a multiple of {_INT4_ROW_MULTIPLE}); load this model "
                "without --quantization"
            )
        self.compute_dtype, self.label = compute_dtype, label
        self.register_buffer(
            "bias", bias.to(compute_dtype) if bias is not None else None, persistent=False
        )
        self.ops = block_kernel()
        self.int8_ops = int8_dot_kernel() if int8_activations else None
        if int8_activations and self.int8_ops is None:
            raise QuantizedWeightError(
                "int8 activations need kvrelay's CPU block kernels, which are off "
                f"({QUANT_KERNEL_ENV}=torch) or could not be built (is a C++ compiler "
                "installed?); drop --int8-activations"
            )
        if self.ops is not None:
            if self.int8_ops is not None:  # held in the int8 kernel's panels instead
                blocks = int8_panels(blocks)
            for name, value in blocks._asdict().items():
                self.register_buffer(name, value, persistent=False)
        self.blocks_for_few_rows = self.ops is not None and (
            int8_activations or self.few_rows_on_blocks(compute_dtype)
        )
        self._few_rows = self._bind_few_rows() if self.blocks_for_few_rows else None
        if not self.blocks_for_few_rows:
            self.int4 = _TorchInt4Planes(planes(), compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out]
        few = self._few_rows
        # int8 activations take the int8 kernel at every row count: at 512 rows it was 2.5x
        # the dequantized dense matmul (oneDNN bf16) on a 2-core Zen 4.
        if few is not None and (self.int8_ops is not None or x.shape[0] < DENSE_FROM_ROWS):
            kernel, weights = few
            return kernel(x, *weights)  # in x's dtype
        if self.ops is not None and x.shape[0] >= DENSE_FROM_ROWS:
            out = self._dense(x.to(self.compute_dtype))
        else:
            out = self.int4.forward(x.to(self.compute_dtype))
            if self.bias is not None:
                out += self.bias
        return out.to(x.dtype)

    @classmethod
    def few_rows_on_blocks(cls, compute_dtype: torch.dtype) -> bool:
        """Whether rows below DENSE_FROM_ROWS take the block kernel's loop (else torch's
        int4 kernel), where the block kernel builds."""
        return True

    def native_matmul(self) -> NativeMatmul | None:
        """This layer's matmul for the decoder stack: the few-row kernel `forward` calls (the
        int8 one at every row count, the block loop below DENSE_FROM_ROWS); None without it."""
        if self._few_rows is None:
            return None
        kernel, (*weights, bias) = self._few_rows
        module = self.int8_ops or self.ops
        assert module is not None
        max_rows = sys.maxsize if self.int8_ops is not None else DENSE_FROM_ROWS - 1
        tensors = [w for w in weights if w is not None]
        return NativeMatmul(f"kvrelay.{kernel.__name__}", tensors, self.out_features, bias,
                            module, max_rows)  # fmt: skip

    def rebind_weights(self) -> None:
        """Bind the few-row kernel to the buffers again, after they moved
        (`models.weight_arena`)."""
        if self._few_rows is not None:
            self._few_rows = self._bind_few_rows()

    def _bind_few_rows(self) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor | None, ...]]:
        """The few-row kernel (the block loop, or the int8 one with `int8_activations`) and
        its weight arguments, bound once: each buffer read through `nn.Module.__getattr__`
        costs about a microsecond, and a decode step makes ~120 of these calls."""
        ops = self.int8_ops or self.ops
        assert ops is not None
        q4_1 = self.m is not None
        if self.int8_ops is not None:
            kernel = ops.q4_1_int8_matmul if q4_1 else ops.q8_0_int8_matmul
        else:
            kernel = ops.q4_1_matmul if q4_1 else ops.q8_0_matmul
        weights = (self.codes, self.d, self.m) if q4_1 else (self.codes, self.d)
        return kernel, (*weights, self.bias)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T + bias` with W dequantized for this call, `DENSE_SLICE_ROWS` output rows
        at a time: a vocab projection's dense copy would be tens of MB, freshly mapped (and
        page-faulted) on every call."""
        if self.out_features <= DENSE_SLICE_ROWS:
            return F.linear(x, self.dequantized(), self.bias)
        out = x.new_empty(x.shape[0], self.out_features)
        for start in range(0, self.out_features, DENSE_SLICE_ROWS):
            rows = slice(start, start + DENSE_SLICE_ROWS)
            bias = self.bias[rows] if self.bias is not None else None
            out[:, rows] = F.linear(x, self.dequantized(rows), bias)
        return out

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        """The `[out, in]` weight (or those `rows` of it) in `compute_dtype` (block kernel
        only; made per call)."""
        assert self.ops is not None and self.int8_ops is None, "int8 layers hold panels"
        codes, d = self.codes[rows], self.d[rows]
        if self.m is not None:
            weight = self.ops.q4_1_dequantize(codes, d, self.m[rows], self.compute_dtype)
        else:
            weight = self.ops.q8_0_dequantize(codes, d, self.compute_dtype)
        return cast(torch.Tensor, weight)

    def extra_repr(self) -> str:
        few = "kvrelay blocks" if self.blocks_for_few_rows else "torch int4"
        many = "kvrelay dequantized, dense" if self.ops is not None else few
        if self.int8_ops is not None:
            few = many = "kvrelay panels x int8 activations"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.label}, compute={self.compute_dtype}, few rows={few}, "
            f"from {DENSE_FROM_ROWS} rows={many}"
        )


class _TorchInt4Planes(nn.Module):
    """int4 planes side by side along K in torch's int4 packing; the input is repeated to
    match, so one `_weight_int4pack_mm_for_cpu` sums every plane."""

    packed_weight: torch.Tensor
    scales_and_zeros: torch.Tensor  # [planes * in / 32, out, 2]

    def __init__(self, planes: Sequence[Plane], compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.planes = len(planes)
        codes = torch.cat([q for q, _, _ in planes], dim=1)  # [out, planes * in]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        # Per group and output row, (scale, zero) as the kernel takes them.
        scales_zeros = torch.cat([torch.stack((s.t(), z.t()), dim=-1) for _, s, z in planes])
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "scales_and_zeros", scales_zeros.to(compute_dtype).contiguous(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] in the compute dtype -> [M, out]
        if self.planes > 1:
            x = x.repeat(1, self.planes)  # [M, planes * in]: each plane sees the input
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed_weight, QUANT_BLOCK, self.scales_and_zeros
        )


class Int4Linear(Int4PlanesLinear):
    """Q4_1 rows: GGUF blocks, or one int4 plane with `scale = d`, `zero = m + 8 d`."""

    @classmethod
    def few_rows_on_blocks(cls, compute_dtype: torch.dtype) -> bool:
        # torch's int4 kernel wins only in bf16, and only where bf16 is native.
        return compute_dtype != torch.bfloat16 or not cpu_has_native_bf16()

    def __init__(
        self,
        raw_q4_1: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        int8_activations: bool = False,
    ) -> None:
        """Args:
        raw_q4_1: `[out, in / 32 * 20]` uint8 Q4_1 rows (see `q4_1_fields`).
        in_features, bias, compute_dtype, int8_activations: as for `Int4PlanesLinear`.

        Raises:
            QuantizedWeightError: the bytes are not Q4_1 rows of that length, or the shape
                does not fit the int4 kernel (see `int4_kernel_fits`).
        """
        blocks = q4_1_blocks(raw_q4_1, in_features)

        def planes() -> list[Plane]:
            codes, d, m = blocks
            assert m is not None
            return [(q4_1_codes(codes, in_features), d, m + _INT4_ZERO_CODE * d)]

        super().__init__(planes, blocks, bias, compute_dtype, "q4_1", int8_activations)


class Q8_0Linear(Int4PlanesLinear):
    """Q8_0 rows: GGUF blocks, or two int4 planes (high and low nibble of `q + 128`; see the
    module doc)."""

    def __init__(
        self,
        raw_q8_0: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        int8_activations: bool = False,
    ) -> None:
        """Args:
        raw_q8_0: `[out, in / 32 * 34]` uint8 Q8_0 rows (see `q8_0_fields`).
        in_features, bias, compute_dtype, int8_activations: as for `Int4PlanesLinear`.

        Raises:
            QuantizedWeightError: the bytes are not Q8_0 rows of that length, or the shape
                does not fit the int4 kernel (see `int4_kernel_fits`).
        """
        blocks = q8_0_blocks(raw_q8_0, in_features)

        def planes() -> list[Plane]:
            u = blocks.codes.to(torch.int32) + _Q8_0_OFFSET
            d = blocks.d
            high = (u >> 4, 16 * d, torch.zeros_like(d))
            low = (u & 0x0F, d, _INT4_ZERO_CODE * d)
            return [high, low]

        super().__init__(planes, blocks, bias, compute_dtype, "q8_0", int8_activations)


def quantized_linear(
    raw: torch.Tensor,
    in_features: int,
    bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
    int8_activations: bool = False,
) -> Int4PlanesLinear:
    """The layer for raw Q4_1 or Q8_0 rows (told apart by `raw_format`)."""
    if raw_format(raw, in_features) == "Q8_0":
        return Q8_0Linear(raw, in_features, bias, compute_dtype, int8_activations)
    return Int4Linear(raw, in_features, bias, compute_dtype, int8_activations)
