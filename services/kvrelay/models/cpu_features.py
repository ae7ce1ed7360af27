"""What the host CPU computes natively: decides `--dtype auto` and which linear path runs.

Read from the kernel's CPU flags (Linux) and from what oneDNN reports, never guessed from the
CPU's name.
"""

from __future__ import annotations

import functools

import torch

from kvrelay_kernels.cpu_flags import cpu_flags

__all__ = ["cpu_flags", "cpu_has_native_bf16", "has_native_bf16_flags"]

# x86: AVX512-BF16 (Cooper Lake, Zen 4 on) and AMX-BF16 (Sapphire Rapids on) compute bf16
# dot products in hardware. Arm: the BF16 extension (Armv8.6) shows up as `bf16`.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def has_native_bf16_flags(flags: frozenset[str]) -> bool:
    """Whether `flags` include an instruction set that computes bf16 in hardware."""
    return bool(flags & _NATIVE_BF16_FLAGS)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 in hardware and oneDNN will use it.

    Without such instructions bf16 is emulated (converted to fp32 and back around every
    op), slower than fp32 itself: `--dtype auto` then stays fp32 on the CPU.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return has_native_bf16_flags(cpu_flags())
