"""Find NIXL's Python API: the `nixl` meta package, or one CUDA variant (`nixl-cu12` alone
is enough and 300 MB smaller). Import only; no agent is created here."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

# The meta package re-exports whichever variant it finds; the variants work on their own.
_CANDIDATES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def load_nixl_api() -> ModuleType:
    """The module holding `nixl_agent` and `nixl_agent_config`.

    Raises:
        ImportError: no NIXL installed (pip install nixl-cu12; or use the gRPC connector).
    """
    errors: list[str] = []
    for name in _CANDIDATES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # a missing module, or a variant that cannot load here
            errors.append(f"{name}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:
            # NIXL logs every agent's start at INFO on each worker; keep its warnings only.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise ImportError(
        "NIXL is not installed (pip install nixl-cu12), or cannot load: "
        + "; ".join(errors)
        + ". The gRPC connector (backend='grpc') needs no NIXL."
    )


def nixl_available() -> bool:
    """Whether the NIXL API imports here."""
    try:
        load_nixl_api()
    except ImportError:
        return False
    return True


# Microseconds the UCX progress thread sleeps when it has nothing to do. NIXL's Python wrapper
# hard-codes 0, a busy spin: measured here, one idle agent burned a whole core (3.9 CPU
# seconds in 2 s), which on a 2-core machine starved the engines and made disaggregated decode
# 4x slower than colocated. At 100 us an idle agent costs ~0 CPU and a pull is as fast.
PROGRESS_THREAD_DELAY_US = 100


def create_agent(api: ModuleType, name: str, config: Any) -> Any:
    """`api.nixl_agent(name, config)` with an idle-friendly progress thread.

    The wrapper builds its `nixlAgentConfig` internally and sets `pthrDelay = 0`; a subclass
    that overrides that one assignment is swapped in for the duration of the call.
    """
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class _IdleFriendlyConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            if key == "pthrDelay":
                value = max(int(value), PROGRESS_THREAD_DELAY_US)
            super().__setattr__(key, value)

    bindings.nixlAgentConfig = _IdleFriendlyConfig
    try:
        return api.nixl_agent(name, config)
    finally:
        bindings.nixlAgentConfig = base
