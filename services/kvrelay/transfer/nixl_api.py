"""Find NIXL's Python API: the `nixl` meta package, or one CUDA variant (`nixl-cu12` alone
is enough and 300 MB smaller). Import only; no agent is created here."""

from __future__ import annotations

import importlib
from types import ModuleType

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
            return importlib.import_module(name)
        except ImportError as exc:  # a missing module, or a variant that cannot load here
            errors.append(f"{name}: {exc}")
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
