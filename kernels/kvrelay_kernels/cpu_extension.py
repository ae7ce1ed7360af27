"""Building kvrelay's CPU C++ extensions on first use (torch cpp_extension, cached by torch).

One place for what every CPU extension needs: build once per process (thread-safe), say so at
warning level when it compiles (a first build takes ~30 s), and fall back (None) where there
is no compiler, so the torch path serves instead.

The extensions are built with `-march=native`, and torch's build cache is keyed on sources and
flags only: a home folder shared by machines with different CPUs (AVX-512 one day, AVX2 the
next) would load a build whose instructions the CPU lacks and die on SIGILL. So each build's
name carries a tag of the CPU's feature flags (`build_name`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from types import ModuleType

from kvrelay_kernels.cpu_flags import cpu_flags, flags_tag

logger = logging.getLogger(__name__)

CSRC_CPU = Path(__file__).parent / "csrc_cpu"
_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}
# A build takes ~30-60 s on 2 cores; a lock older than this was left by a killed one.
STALE_LOCK_S = 600.0


def load_cpu_extension(name: str, source: str, flags: list[str], what: str) -> ModuleType | None:
    """The extension `name` compiled from `csrc_cpu/<source>`, built on the first call.

    Args:
        name: the module's name (torch's build cache folder too).
        source: the C++ file under `csrc_cpu`.
        flags: extra compiler flags.
        what: how a log line names it ("CPU attention kernel").

    Returns:
        The module, or None where it cannot be built (logged once).
    """
    if name in _built:  # the hot path (every layer op asks): no lock once it is settled
        return _built[name]
    with _lock:
        if name not in _built:
            _built[name] = _build(build_name(name), CSRC_CPU / source, flags, what)
        return _built[name]


def build_name(name: str, flags: frozenset[str] | None = None) -> str:
    """The module and build-cache name of extension `name` on a CPU with `flags` (this one's
    when None): one build per instruction-set combination."""
    return f"{name}_{flags_tag(cpu_flags() if flags is None else flags)}"


def _build(name: str, source: Path, flags: list[str], what: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        clear_stale_build_lock(name)
        if not _is_built(name):
            logger.warning("compiling kvrelay's %s (first use only, ~30 s)", what)
        module: ModuleType = load(
            name=name,
            sources=[str(source)],
            extra_cflags=[*flags, headers_flag()],
            verbose=False,
        )
        return module
    except Exception as exc:  # no compiler or ninja: serve with the torch path instead
        logger.warning("%s unavailable (%s); using the torch path", what, exc)
        return None


def headers_flag() -> str:
    """A define naming the hash of the headers under `csrc_cpu`: torch keys its build cache on
    the sources and the flags, not on what they include, so an edited header (kernel_api.h's
    signatures) would otherwise leave a stale build in place."""
    digest = hashlib.sha256()
    for header in sorted(CSRC_CPU.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"-DKVRELAY_HEADERS_{digest.hexdigest()[:16]}"


def clear_stale_build_lock(name: str, older_than_s: float = STALE_LOCK_S) -> bool:
    """Remove the lock file of `name`'s build folder when it is older than `older_than_s`;
    returns whether one was removed.

    torch's build takes that lock and waits, without end, while another process holds it. A
    process killed mid-build (a worker replaced, a test run interrupted) leaves it behind, and
    every later process would then hang at its first kernel call; no build runs for minutes.
    """
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except Exception:  # no lock (the usual case), or no build folder yet
        return False
    if age < older_than_s:
        return False
    logger.warning("removing a stale build lock (%.0f s old) left by a killed build: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def _is_built(name: str) -> bool:
    """Whether torch's extension cache already holds the compiled module (best effort)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, False))
    except Exception:
        return False
    return (folder / f"{name}.so").is_file()
