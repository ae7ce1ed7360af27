"""Give glibc's freed heap memory back to the kernel when a worker's engine goes idle, at most
once per interval: `malloc_trim(0)`, called from the engine loop's thread between steps.

Why: a prefill worker's steps allocate activations whose sizes follow the prompt lengths, on
several threads (the loop's, the KV pulls', Ray's), so glibc's heaps fill with free holes it
keeps (it returns only the top of the main heap, past M_TRIM_THRESHOLD). Its RSS then crept
after warm-up although the memory in use did not grow (issue 41; the 2026-11-30 soak: a
`malloc_trim(0)` gave back ~170 MiB). It never runs inside a step; between steps while
requests wait only when the engine has not been idle for BUSY_FACTOR intervals (a prefill
worker under steady load: 2 idle moments in 5 minutes of an 8-stream soak), costing one
trim's 3-5 ms once a minute (30-minute soak: 41 trims took 208 ms in all in the
prefill worker, 165 took 681 ms in the decode worker).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.common import env

logger = logging.getLogger(__name__)

HEAP_TRIM_ENV = env.HEAP_TRIM_S.name  # seconds between trims at most; "0" turns them off
DEFAULT_INTERVAL_S = 10.0
BUSY_FACTOR = 6  # with no idle moment for this many intervals, trim between two steps


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    """libc's `malloc_trim`, or None where libc has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def rss_bytes() -> int:
    """This process's resident set (0 off Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def interval_from_env(environ: dict[str, str] | None = None) -> float:
    """$KVRELAY_HEAP_TRIM_S as seconds (default 10; 0: never trim); a clear error otherwise."""
    raw = (os.environ if environ is None else environ).get(HEAP_TRIM_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"${HEAP_TRIM_ENV} must be seconds >= 0 (0: never trim), not {raw!r}")
    return value


@dataclass
class TrimStats:
    trims: int = 0
    released_bytes: int = 0  # RSS before minus after, summed (what the kernel got back)
    seconds: float = 0.0  # time spent in malloc_trim


class HeapTrimmer:
    """Call `worked()` after a step and `idle()` when the engine has nothing to run: `idle`
    trims once per stretch of work, never sooner than `interval_s` after the last trim;
    `worked` trims only when BUSY_FACTOR intervals passed since the last trim."""

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rss: Callable[[], int] = rss_bytes,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 (0: never trim), not {interval_s}")
        self.interval_s = interval_s
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._clock = clock
        self._rss = rss
        self._last = clock()
        self._dirty = False  # work happened since the last trim
        self.stats = TrimStats()
        if interval_s and self._trim is None:
            logger.info("no malloc_trim in this libc: freed heap memory is not trimmed")

    @property
    def enabled(self) -> bool:
        return bool(self.interval_s) and self._trim is not None

    def worked(self) -> bool:
        """After a step: trim if the engine has been busy BUSY_FACTOR intervals since the
        last trim; whether it trimmed."""
        self._dirty = True
        return self._trim_after(self.interval_s * BUSY_FACTOR)

    def idle(self) -> bool:
        """Trim now if there was work since the last trim and the interval has passed;
        whether it trimmed."""
        return self._dirty and self._trim_after(self.interval_s)

    def _trim_after(self, interval_s: float) -> bool:
        if not self.enabled:
            return False
        now = self._clock()
        if now - self._last < interval_s:
            return False
        assert self._trim is not None  # enabled
        before = self._rss()
        self._trim(0)
        after = self._rss()
        self._last = self._clock()
        self._dirty = False
        self.stats.trims += 1
        self.stats.released_bytes += max(0, before - after)
        self.stats.seconds += self._last - now
        return True
