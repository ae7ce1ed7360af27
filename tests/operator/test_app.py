"""`kvrelay operator`'s flags and the kopf registry (no cluster: nothing is started)."""

from __future__ import annotations

import argparse
import subprocess
import sys

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


def _imports(code: str) -> set[str]:
    """Every module `code` imports, from `python -X importtime` in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if "|" in line}


def _chart_entry_module() -> str:
    """The module the chart's operator container starts: `python -m X`, or the `kvrelay`
    console script's module."""
    import helm_python as helm
    import yaml

    from tests.deploy.schemas import CHART

    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values={}, name="kv", namespace="ns", is_install=True)
    text = next(v for k, v in manifests.items() if k.endswith("operator-deployment.yaml"))
    command = yaml.safe_load(text)["spec"]["template"]["spec"]["containers"][0]["command"]
    if command[:2] == ["python", "-m"]:
        return str(command[2])
    assert command[0] == "kvrelay"
    return "kvrelay.cli"


def test_the_operator_process_never_imports_torch() -> None:
    """Defect 11: the operator pod's entry point (the chart's command) and everything it
    loads to run kopf must not pull torch in (300+ MB under a 512 Mi limit)."""
    entry = _chart_entry_module()
    modules = _imports(
        f"import {entry}, kvrelay_operator.handlers, kvrelay_operator.crds, "
        "kopf, kubernetes, prometheus_client"
    )
    assert "kvrelay_operator.handlers" in modules and "kopf" in modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert not {m for m in modules if m == "ray" or m.startswith("kvrelay.")}


def test_the_module_entry_point_has_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvrelay_operator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for flag in ("--all-namespaces", "--peering", "--log-level", "--standalone"):
        assert flag in result.stdout


def test_no_handler_puts_a_finalizer_on_a_service() -> None:
    """Defect 11: kopf adds a finalizer for any handler that requires one (its timers do by
    default); with the operator uninstalled first, deleting a service would hang on it."""
    registry = build_registry(resync_seconds=30, planner_seconds=15)
    handlers = [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers()]
    assert handlers
    assert not [h.id for h in handlers if getattr(h, "requires_finalizer", None)]


def test_replicas_peer_with_a_random_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 11: two replicas, one acting: kopf peering (not standalone), each replica with its
    own priority (equal priorities would pause both)."""
    import kopf
    import kubernetes

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    for _ in range(2):
        args = _parse("--all-namespaces", "--peering", "kv-operator", "--metrics-port", "0")
        assert run_operator(args) == 0
    assert [c["standalone"] for c in calls] == [False, False]
    assert {c["peering_name"] for c in calls} == {"kv-operator"}
    assert calls[0]["priority"] != calls[1]["priority"]
    assert calls[0]["clusterwide"] is True
    # Standalone (one operator, no peering CRDs) names no peering object.
    assert run_operator(_parse("--namespace", "a", "--standalone", "--metrics-port", "0")) == 0
    assert (calls[2]["standalone"], calls[2]["peering_name"]) == (True, None)
