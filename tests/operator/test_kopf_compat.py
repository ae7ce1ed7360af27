"""kopf's private registry is touched in one function (kopf_compat), on a tested kopf: the
installed kopf is inside both TESTED_KOPF and pyproject's pin, the wrapper really clears the
timers' finalizer flag, and a registry shaped otherwise is refused with a message that says
what to do (issue 43)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from dataclasses import dataclass
from typing import Any

import kopf
import pytest

from kvrelay_operator.kopf_compat import (
    TESTED_KOPF,
    KopfCompatError,
    is_tested,
    kopf_version,
    timers_without_finalizers,
)
from tests.deploy.schemas import ROOT


def _kopf_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if re.match(r"^kopf\b", d))


def test_the_installed_kopf_is_a_tested_one() -> None:
    """Fails on an untested kopf: widen TESTED_KOPF (and the pin) only after the operator
    tests pass on it."""
    assert is_tested(kopf_version()), (
        f"kopf {kopf_version()} is outside TESTED_KOPF {TESTED_KOPF}: run tests/operator on it, "
        "then widen TESTED_KOPF in kvrelay_operator/kopf_compat.py and the pin in pyproject"
    )


def test_pyproject_pins_kopf_to_the_tested_range() -> None:
    low, high = TESTED_KOPF
    assert _kopf_pin() == f"kopf>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


@pytest.mark.parametrize(
    ("text", "ok"),
    [("1.45.2", True), ("1.45.0", True), ("1.44.9", False), ("1.46.0", False), ("x", False)],
)
def test_tested_compares_major_minor(text: str, ok: bool) -> None:
    assert is_tested(text) is ok


def _registry_with_a_timer() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.timer("example.com", "v1", "things", interval=5, registry=registry)
    def tick(**_: Any) -> None:
        pass

    return registry


def test_timers_lose_their_finalizer_on_the_installed_kopf() -> None:
    registry = _registry_with_a_timer()
    before = list(registry._spawning.get_all_handlers())
    assert [h.requires_finalizer for h in before] == [True]  # kopf's own default
    timers_without_finalizers(registry)
    after = registry._spawning.get_all_handlers()
    assert [(h.id, h.requires_finalizer) for h in after] == [(before[0].id, False)]


def test_a_registry_without_the_private_list_is_refused() -> None:
    class Moved:
        _spawning = object()

    with pytest.raises(KopfCompatError, match=r"_spawning\._handlers.*pip install 'kopf>=1\.45"):
        timers_without_finalizers(Moved())


def test_a_handler_without_the_flag_is_refused() -> None:
    @dataclass(frozen=True)
    class Handler:
        id: str

    class Spawning:
        def __init__(self) -> None:
            self._handlers = [Handler("t")]

    class Registry:
        def __init__(self) -> None:
            self._spawning = Spawning()

    with pytest.raises(KopfCompatError, match="requires_finalizer"):
        timers_without_finalizers(Registry())


def test_only_kopf_compat_touches_kopf_private_names() -> None:
    """One wrapper, so a kopf upgrade has one place to check."""
    pattern = r"\._(spawning|changing|watching|handlers|activities|indexing|webhooks)\b"
    found = subprocess.run(
        ["grep", "-rlE", pattern, "operators/kvrelay_operator", "--include=*.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.split()
    assert found == ["operators/kvrelay_operator/kopf_compat.py"]
