"""What the host CPU computes natively: decides `--dtype auto` and which linear path runs.

Read from the kernel's CPU flags (Linux) and from what oneDNN reports, never guessed from the
CPU's name.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# x86: AVX512-BF16 (Cooper Lake, Zen 4 on) and AMX-BF16 (Sapphire Rapids on) compute bf16
# dot products in hardware. Arm: the BF16 extension (Armv8.6) shows up as `bf16`.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (`flags` on x86, `Features` on Arm); empty where unknown.

    Args:
        cpuinfo: the text of /proc/cpuinfo; read from the system when None.
    """
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:  # not Linux, or /proc hidden: no flags known
            return frozenset()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


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
