"""The host CPU's feature flags, read from the kernel (Linux), never guessed from its name.

Here, in the lowest layer, because the CPU extensions' builds are keyed on them; the engine's
choices (bf16 by default, the linear paths) read them through `kvrelay.models.cpu_features`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name (`model name` on x86); "unknown" where /proc/cpuinfo has none.

    Args:
        cpuinfo: the text of /proc/cpuinfo; read from the system when None.
    """
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            return "unknown"
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "model name" and value.strip():
            return value.strip()
    return "unknown"


def flags_tag(flags: frozenset[str]) -> str:
    """A short stable name for a set of flags: two CPUs share it only if they have the same
    instruction sets (so a `-march=native` build made on one is safe to load on the other)."""
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:10]
