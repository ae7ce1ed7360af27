"""Test helpers: whether this host honours huge-page advice, and a mapping's flags."""

from __future__ import annotations

import sys
from pathlib import Path

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_advice_works() -> bool:
    """Linux with transparent huge pages that honour madvise (`always` or `madvise`)."""
    return sys.platform == "linux" and _THP.exists() and "[never]" not in _THP.read_text()


def vma_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
