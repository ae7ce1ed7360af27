"""Counts Triton JIT compiles, and flags those that happen while serving.

Triton compiles a kernel variant (its constexprs, dtypes and integer specializations) the
first time a process launches it: ptxas alone takes ~0.2 s, so a variant first met in the
middle of serving stalls every request of that step. An engine warms up every variant it can
launch before it says it is ready (`engine/warm_up.py`); this module checks that it did:
`COUNTERS.jit_compiles` counts every variant compiled (or loaded from Triton's disk cache,
which costs a load and a module init) in this process, and `COUNTERS.jit_compiles_after_ready`
those that happened after an engine became ready while no engine was warming up. The GPU
check requires the latter to stay 0.

The hook is Triton's `jit_cache_hook` (`triton.knobs.runtime`, Triton >= 3.4; the class
attribute `JITFunction.cache_hook` before), called once per variant before it is compiled. A
hook that returns a true value makes Triton skip the compile, so ours always returns None
and chains to a hook someone else installed. Nothing here imports Triton until `install`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvrelay_kernels.counters import COUNTERS

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state = {"installed": False, "ready": False, "warming": 0}


def on_compile(*args: Any, **kwargs: Any) -> None:
    """Triton's cache hook: one new variant of a kernel is about to be compiled."""
    COUNTERS.jit_compiles += 1
    with _lock:
        serving = _state["ready"] and not _state["warming"]
    if serving:
        COUNTERS.jit_compiles_after_ready += 1
        logger.warning(
            "Triton compiled %s while serving: a variant the engine's warm-up did not reach",
            kwargs.get("repr") or kwargs.get("key") or "a kernel",
        )


def _chained(previous: Callable[..., Any] | None) -> Callable[..., None]:
    def hook(*args: Any, **kwargs: Any) -> None:
        on_compile(*args, **kwargs)
        if previous is not None:
            previous(*args, **kwargs)
        # Never return the previous hook's answer as ours: a true value skips the compile,
        # and a kernel launched without its binary would fail; a tool that wants that
        # (Triton's own AOT paths) does not run inside a serving engine.

    hook.kvrelay_jit_watch = True  # type: ignore[attr-defined]
    return hook


def install() -> bool:
    """Install the hook once per process (a no-op without Triton); True when it is in."""
    with _lock:
        if _state["installed"]:
            return True
        try:
            import triton
        except ImportError:
            return False
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            knobs.runtime.jit_cache_hook = _chained(knobs.runtime.jit_cache_hook)
        else:  # Triton < 3.4
            from triton.runtime.jit import JITFunction

            JITFunction.cache_hook = _chained(JITFunction.cache_hook)
        _state["installed"] = True
        return True


@contextlib.contextmanager
def warming_up() -> Iterator[None]:
    """An engine's start-up: compiles inside are expected (the warm-up's purpose)."""
    with _lock:
        _state["warming"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["warming"] -= 1
            _state["ready"] = True


def reset() -> None:
    """Forget readiness (tests; a process that serves again from scratch)."""
    with _lock:
        _state["ready"] = False
        _state["warming"] = 0
