"""kvrelay's AVX2 single-row matmul for CPU decode, built once on first use (JIT, cached).

`gemv(x, weight, bias)` is `F.linear` for one fp32 row. When the machine cannot build or run
it (no compiler, no AVX2), `available()` is False and callers keep the torch path.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu" / "gemv.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    logger.info("building kvrelay's CPU gemv kernel (once, cached by torch)")
    try:
        return load(
            name="kvrelay_cpu_gemv",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja must not stop serving
        logger.warning("CPU gemv kernel unavailable, using torch matmul instead: %s", exc)
        return None


def load_module() -> ModuleType | None:
    """The compiled extension, building it on first call; None where it cannot run."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            _module = _build() if _cpu_has_avx2() else None
            _failed = _module is None
    return _module


def available() -> bool:
    return load_module() is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for `x: [1, K]` fp32; weight `[N, K]` contiguous. Returns `[1, N]`.

    Raises:
        RuntimeError: the kernel is not available (check `available()` first).
    """
    module = load_module()
    if module is None:
        raise RuntimeError("the CPU gemv kernel is not available on this machine")
    out: torch.Tensor = module.gemv(x, weight, bias)
    return out
