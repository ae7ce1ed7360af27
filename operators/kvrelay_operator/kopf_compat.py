"""The one place the operator reaches into kopf's private API, and the kopf versions it was
tested with.

kopf registers timers with `requires_finalizer=True` and offers no public flag to change it
(kopf 1.45: `kopf.on.timer` passes the literal); `timers_without_finalizers` rewrites the
registry's spawning handlers instead. It checks the private shapes it touches first and
refuses, naming the kopf version and what to do, rather than half-working on a kopf whose
internals moved. Nothing else in the package may touch a `_`-prefixed kopf attribute.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import PackageNotFoundError, version
from typing import Any

# The kopf minor versions the operator and its tests ran on; pyproject pins the same range
# (`kopf>=1.45,<1.46`) and tests/operator/test_kopf_compat.py checks the two agree.
TESTED_KOPF = ((1, 45), (1, 45))


class KopfCompatError(RuntimeError):
    """The installed kopf is not shaped like the tested one."""


def kopf_version() -> str:
    try:
        return version("kopf")
    except PackageNotFoundError:
        return "unknown"


def is_tested(kopf: str) -> bool:
    """Whether a kopf version string falls in TESTED_KOPF (by major.minor)."""
    try:
        major, minor = (int(part) for part in kopf.split(".")[:2])
    except ValueError:
        return False
    low, high = TESTED_KOPF
    return low <= (major, minor) <= high


def _refuse(what: str) -> KopfCompatError:
    low, high = TESTED_KOPF
    return KopfCompatError(
        f"kopf {kopf_version()}: {what}; kvrelay_operator.kopf_compat was written for kopf "
        f"{low[0]}.{low[1]}-{high[0]}.{high[1]}. Install a tested kopf "
        f"(pip install 'kopf>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}') or port "
        "timers_without_finalizers to this kopf and widen TESTED_KOPF and the pin"
    )


def _spawning_handlers(registry: Any) -> list[Any]:
    """The registry's timer and daemon handlers (private), checked for the expected shape."""
    spawning = getattr(registry, "_spawning", None)
    handlers = getattr(spawning, "_handlers", None)
    if not isinstance(handlers, list):
        raise _refuse("the registry has no list at _spawning._handlers")
    for handler in handlers:
        fields = {f.name for f in dataclasses.fields(handler)} if _is_dataclass(handler) else set()
        if "requires_finalizer" not in fields:
            raise _refuse(f"timer handler {handler!r} is no dataclass with requires_finalizer")
    return handlers


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def timers_without_finalizers(registry: Any) -> None:
    """Make every timer and daemon of `registry` run without a finalizer on its objects.

    Raises:
        KopfCompatError: kopf's registry is not shaped as in the tested versions.
    """
    spawning = registry._spawning
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) for h in _spawning_handlers(registry)
    ]
