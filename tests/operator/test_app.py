"""`kvrelay operator`'s flags and the kopf registry (no cluster: nothing is started)."""

from __future__ import annotations

import argparse

import pytest

from kvrelay_operator import add_operator_arguments, run_operator
from kvrelay_operator.handlers import build_registry


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvrelay operator")
    add_operator_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_safe() -> None:
    ns = _parse("--namespace", "a", "--namespace", "b")
    assert ns.namespace == ["a", "b"] and not ns.all_namespaces
    assert ns.probe_host == "127.0.0.1"  # never all interfaces unless asked
    assert (ns.probe_port, ns.metrics_port) == (8080, 9090)


def test_scope_flags_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        _parse("--namespace", "a", "--all-namespaces")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "--namespace NS or --all-namespaces"),
        (("--all-namespaces", "--resync-seconds", "0"), "positive"),
    ],
)
def test_run_refuses_a_bad_configuration_before_starting(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_operator(_parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_registry_has_the_handlers() -> None:
    registry = build_registry(resync_seconds=30, planner_seconds=15)
    changing = {
        h.id.removeprefix("build_registry.<locals>.") for h in registry._changing.get_all_handlers()
    }
    assert changing == {"on_service", "on_pool_scaled/spec.replicas", "on_delete"}
    timers = {
        h.id.removeprefix("build_registry.<locals>.") for h in registry._spawning.get_all_handlers()
    }
    assert timers == {"resync", "planner"}
