"""What the host CPU computes natively: decides `--dtype auto` and which linear path runs.

Read from the kernel's CPU flags (Linux) and from what oneDNN reports, never guessed from the
CPU's name.
"""

from __future__ import annotations

import functools

import torch

from kvrelay_kernels.cpu_amx import amx_enabled, has_amx_flags
from kvrelay_kernels.cpu_flags import cpu_flags, cpu_model_name

__all__ = [
    "cpu_feature_summary",
    "cpu_flags",
    "cpu_has_native_bf16",
    "feature_summary",
    "has_native_bf16_flags",
]

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


# The instruction sets that decide kvrelay's CPU paths, in the order the summary names them.
_SUMMARY_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def feature_summary(model: str, flags: frozenset[str], amx_granted: bool) -> str:
    """One line naming the CPU and the instruction sets kvrelay's paths depend on, e.g.
    `AMD EPYC: avx512_bf16 avx512f avx2; AMX: not on this CPU`.

    Args:
        model: the CPU's model name. flags: its flags. amx_granted: whether the kernel gave
            this process the tile state (`kvrelay_kernels.cpu_amx.enable_amx`).
    """
    present = " ".join(flag for flag in _SUMMARY_FLAGS if flag in flags) or "none of avx2/avx512"
    if not has_amx_flags(flags):
        amx = "not on this CPU"
    else:
        amx = "granted, oneDNN's bf16 uses tiles" if amx_granted else "refused by the kernel"
    return f"{model}: {present}; AMX: {amx}"


def cpu_feature_summary() -> str:
    """`feature_summary` of this machine (asks for AMX once, where the CPU has it)."""
    return feature_summary(cpu_model_name(), cpu_flags(), amx_enabled())
