"""GGUF Q4_1 and Q8_0 weight blocks on the CPU (csrc_cpu/block_quant_matmul.cpp): exact
dequantization to a dense weight, and the matmul of either format with each block dequantized
in registers (the weight stays 5 or 8.5 bits each in memory, the arithmetic is fp32).

`kvrelay.models.quantized` calls these when the extension builds; otherwise it runs torch's
packed int4 kernel alone.
"""

from __future__ import annotations

from types import ModuleType

from kvrelay_kernels.cpu_extension import load_cpu_extension

# Multiply-adds fused (a product of a code and its scale is exact, so fusing changes no
# weight); no fast-math: the sums are ordered by the tiling, not by the compiler's licence.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


def load_block_quant_ops() -> ModuleType | None:
    """The compiled module (`q4_1_matmul`, `q8_0_matmul`, `q4_1_dequantize`,
    `q8_0_dequantize`), built on the first call; None where it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_block_quant", "block_quant_matmul.cpp", _FLAGS, "CPU Q4_1/Q8_0 matmul"
    )


def load_int8_dot_ops() -> ModuleType | None:
    """The compiled module of csrc_cpu/int8_dot_matmul.cpp (`q4_1_int8_matmul`,
    `q8_0_int8_matmul`, `int8_quantize`): the same blocks times activations quantized to int8
    per 32 values, by integer dot products; None where it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_int8_dot", "int8_dot_matmul.cpp", _FLAGS, "CPU int8-activation matmul"
    )
