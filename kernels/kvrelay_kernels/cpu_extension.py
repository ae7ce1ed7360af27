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

import contextlib
import fcntl
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from kvrelay_kernels.cpu_flags import cpu_flags, flags_tag

logger = logging.getLogger(__name__)

CSRC_CPU = Path(__file__).parent / "csrc_cpu"
_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}


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

        if not _is_built(name):
            logger.warning("compiling kvrelay's %s (first use only, ~30 s)", what)
        with build_guard(name):
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


@contextlib.contextmanager
def build_guard(name: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `name`'s build folder around torch's `load`, and drop a
    torch lock file found while holding it.

    Every process takes torch's lock file on its first `load`, even when the module is built
    (ninja's no-op check runs under it). A process killed right then (a test ending while a
    worker still loads, a replaced pod) leaves the file, and every later process waits on it
    without end. The kernel releases a `flock` when its holder dies; so while we hold ours, no
    live kvrelay process is inside `load`, and a torch lock file is one a dead process left.
    """
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "kvrelay.flock", "a+b") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        left = folder / "lock"
        if left.exists():
            logger.warning("removing a build lock left by a process that died in it: %s", left)
            left.unlink(missing_ok=True)
        yield  # closing the file releases the flock


def _is_built(name: str) -> bool:
    """Whether torch's extension cache already holds the compiled module (best effort)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, False))
    except Exception:
        return False
    return (folder / f"{name}.so").is_file()
