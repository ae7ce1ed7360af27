"""AMX tile state for this process. Linux hands a process the AMX tile registers only after it
asks (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a tile instruction before that
kills the process with SIGILL.

oneDNN (torch's bf16 matmuls) asks for itself in recent versions; kvrelay asks once before it
measures the many-row paths (`kvrelay.models.many_rows`), so the worker's log says whether AMX
serves, and so any tile code of ours runs only where the answer was yes. Never raises: where
the CPU has no AMX, or the kernel refuses (too old, or a seccomp filter), the answer is False
and the AVX-512 paths serve.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys
from collections.abc import Callable

from kvrelay_kernels.cpu_flags import cpu_flags

logger = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86-64's syscall number (asm/unistd_64.h)
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18  # the tile data's bit in the XSAVE feature mask
# Both must show: the tile registers themselves, and the bf16 dot products kvrelay's bf16
# matmuls would run on them.
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})

Syscall = Callable[[int, int, int], int]  # (number, code, argument) -> the kernel's return


def has_amx_flags(flags: frozenset[str]) -> bool:
    """Whether `flags` (`cpu_flags`) name AMX tiles with bf16 dot products."""
    return flags >= AMX_FLAGS


def _libc_syscall(number: int, code: int, argument: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result: int = libc.syscall(ctypes.c_long(number), ctypes.c_long(code), ctypes.c_ulong(argument))
    return result


def request_tile_permission(syscall: Syscall | None = None) -> bool:
    """Ask the kernel for the tile data state once, then read back whether it is granted.

    Args:
        syscall: the raw system call; libc's `syscall` when None (tests inject one).

    Returns:
        True when this process may run AMX instructions. False where the kernel refuses
        (no AMX on this CPU, a kernel before 5.16, a filter), never an exception.
    """
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False  # the syscall number and the feature bit are x86-64 Linux's
    call = _libc_syscall if syscall is None else syscall
    try:
        if call(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            return False
        mask = ctypes.c_ulong(0)
        if call(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
            return False
    except (OSError, AttributeError):  # no libc `syscall` (musl builds differ): no AMX
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def enable_amx(flags: frozenset[str], syscall: Syscall | None = None) -> bool:
    """Request AMX for this process where `flags` show it, and log the outcome in one line.

    Args:
        flags: the CPU's flags (`cpu_flags()`); without AMX nothing is asked.
        syscall: see `request_tile_permission`.

    Returns:
        Whether AMX tiles may be used.
    """
    if not has_amx_flags(flags):
        return False
    granted = request_tile_permission(syscall)
    if granted:
        logger.info("AMX: tile state granted (amx_tile, amx_bf16); oneDNN's bf16 uses tiles")
    else:
        logger.warning("AMX: the CPU has tiles but the kernel refused them; AVX-512 serves")
    return granted


@functools.cache
def amx_enabled() -> bool:
    """`enable_amx` on this machine's flags, asked once per process."""
    return enable_amx(cpu_flags())
