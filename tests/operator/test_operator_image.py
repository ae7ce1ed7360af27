"""A slim operator image and what the chart does with it (issue 43): the Dockerfile's
`operator` target installs only the operator's pinned requirements (no torch, no CUDA, no
Ray), the package imports and runs with torch, Ray and kvrelay unimportable, the chart runs
the operator and its CRD hook from that image while services keep theirs, passes its pull
secrets to every service pod, and gives the operator a PodDisruptionBudget. The CPU image
flavour builds the CPU kernels in."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from packaging.requirements import Requirement

from kvrelay_operator.app import add_operator_arguments
from kvrelay_operator.desired import desired_objects
from kvrelay_operator.handlers import with_operator_pull_secrets
from kvrelay_operator.spec import parse_service
from tests.deploy.schemas import CHART, KUBE_VERSIONS, ROOT, validate_object
from tests.deploy.test_chart import render
from tests.deploy.test_dockerfile import _stages, _text
from tests.operator.services import IMAGE, service_body

Obj = dict[str, Any]
DOCKER = ROOT / "deploy" / "docker"
sys.path.insert(0, str(DOCKER))
import build_cpu_kernels  # noqa: E402
import operator_requirements  # noqa: E402

# --- the Dockerfile's operator target --------------------------------------------------


def test_the_operator_target_installs_only_the_operators_requirements() -> None:
    stages = list(_stages())
    assert stages.index("operator") < stages.index("final")  # `docker build .`: services'
    text = _text("operator")
    assert text.startswith("FROM python:${PYTHON_VERSION}-slim-bookworm AS operator")
    assert "python /tmp/operator_requirements.py pyproject.toml > /tmp/requirements.txt" in text
    assert "pip install -q --no-deps ." in text
    # Nothing heavy: not the build stage's venv, not the cluster extra, not the toolkit.
    for heavy in ("--from=", "[cluster]", "cuda", "KERNELS", "build-essential"):
        assert heavy not in text, heavy
    assert 'import torch" 2>/dev/null; then' in text  # the build fails if torch got in
    assert "USER 1000:1000" in text


def test_operator_requirements_are_pyprojects_pins() -> None:
    reqs = operator_requirements.operator_requirements(ROOT / "pyproject.toml")
    assert [operator_requirements.requirement_name(r) for r in reqs] == [
        "kopf",
        "kubernetes",
        "prometheus-client",
    ]
    assert reqs[0] == "kopf>=1.45,<1.46"  # the tested range (test_kopf_compat.py)
    result = subprocess.run(
        [sys.executable, str(DOCKER / "operator_requirements.py"), str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split("\n")[:3] == reqs


def test_a_requirement_gone_from_pyproject_fails_the_build(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["kopf>=1.45,<1.46", "kubernetes>=30"]\n')
    with pytest.raises(SystemExit, match="prometheus-client"):
        operator_requirements.operator_requirements(pyproject)


def _third_party_imports() -> set[str]:
    """Top-level modules kvrelay_operator imports that are neither stdlib nor its own."""
    out = set()
    for path in (ROOT / "operators" / "kvrelay_operator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            out |= {n.split(".")[0] for n in names}
    return {m for m in out if m not in sys.stdlib_module_names and m != "kvrelay_operator"}


def _provided(dists: list[str]) -> set[str]:
    """Top-level modules of `dists` and everything they require, installed here."""
    seen: set[str] = set()
    modules: set[str] = set()
    todo = list(dists)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        dist = distribution(name)
        top = dist.read_text("top_level.txt")
        files = [str(f).split("/")[0].removesuffix(".py") for f in dist.files or ()]
        modules |= set(top.split()) if top else {f for f in files if f.isidentifier()}
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return modules


def test_the_image_provides_every_module_the_operator_imports() -> None:
    imports = _third_party_imports()
    assert {"kopf", "kubernetes", "prometheus_client", "yaml"} <= imports
    missing = imports - _provided(list(operator_requirements.OPERATOR_DISTRIBUTIONS))
    assert not missing, f"add to OPERATOR_DISTRIBUTIONS: {missing}"


BLOCKER = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'ray', 'kvrelay', 'numpy', 'transformers'):
            raise ImportError(f'{name} is not in the operator image')
sys.meta_path.insert(0, Block())
import pkgutil, importlib, kvrelay_operator
for m in pkgutil.iter_modules(kvrelay_operator.__path__):
    importlib.import_module('kvrelay_operator.' + m.name)
from kvrelay_operator.handlers import build_registry
from kvrelay_operator.crds import CRD_FILES, render_yaml
build_registry(30, 15)
print(len([render_yaml(b()) for b in CRD_FILES.values()]))
"""


def test_the_operator_runs_where_torch_ray_and_kvrelay_cannot_be_imported() -> None:
    """What the slim image holds: every operator module, its registry and the CRD hook."""
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "4"


# --- the CPU flavour's kernels -----------------------------------------------------------


def test_the_cpu_stage_builds_the_kernels_the_final_image_keeps() -> None:
    cpu = _text("kernels-cpu")
    assert "ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions" in cpu
    assert "RUN python /tmp/build_cpu_kernels.py" in cpu
    final = _text("final")
    assert "COPY --from=kernels --chown=1000:1000 /opt/torch_extensions /opt/torch_extensions" in (
        final
    )
    assert "TORCH_EXTENSIONS_DIR=/opt/torch_extensions" in final
    assert "mkdir -p /opt/torch_extensions" in _text("build")  # the CUDA flavour copies it too


def test_the_build_script_loads_every_cpu_extension() -> None:
    """A new CPU kernel must be built into the image too."""
    callers = set()
    for path in (ROOT / "kernels" / "kvrelay_kernels").glob("cpu_*.py"):
        if path.stem == "cpu_extension":  # the builder itself
            continue
        tree = ast.parse(path.read_text())
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and "load_cpu_extension(" in ast.unparse(fn):
                callers.add((f"kvrelay_kernels.{path.stem}", fn.name))
    assert callers == set(build_cpu_kernels.LOADERS)


def test_the_build_script_builds_or_fails_loudly() -> None:
    """Run for real (torch's cache makes it quick where the kernels were built before), two
    builds at a time as `make test` runs it."""
    result = subprocess.run(
        [sys.executable, str(DOCKER / "build_cpu_kernels.py"), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(": ok") == len(build_cpu_kernels.LOADERS)


# --- the chart ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _kinds(objects: list[Obj]) -> dict[str, list[Obj]]:
    out: dict[str, list[Obj]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


PULL = {"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]}


def test_operator_and_crd_hook_run_the_operator_image_services_keep_theirs(
    chart: helm.Chart,
) -> None:
    values = {**PULL, "operator": {"image": {"repository": "reg/kvrelay-operator", "tag": "7"}}}
    kinds = _kinds(render(chart, values))
    (deployment,) = kinds["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "reg/kvrelay-operator:7"
    command = container["command"]
    assert command[command.index("--image") + 1] == "kvrelay:0.1.0"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVRELAY_IMAGE"] == "kvrelay:0.1.0"
    # The chart's pull secrets: the operator's own pod, and passed on for service pods.
    assert pod["imagePullSecrets"] == PULL["imagePullSecrets"]
    flags = [command[i + 1] for i, word in enumerate(command) if word == "--image-pull-secret"]
    assert flags == ["regcred", "mirror"]
    (hook,) = kinds["Job"]
    assert hook["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/kvrelay-operator:7"
    default = _kinds(render(chart))
    assert default["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "kvrelay-operator:0.1.0"
    )


def test_the_operator_has_a_disruption_budget(chart: helm.Chart) -> None:
    objects = render(chart)
    kinds = _kinds(objects)
    (pdb,) = kinds["PodDisruptionBudget"]
    (deployment,) = kinds["Deployment"]
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]},
    }
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for version in KUBE_VERSIONS:
        validate_object(pdb, version)
    off = render(chart, {"operator": {"podDisruptionBudget": {"enabled": False}}})
    assert "PodDisruptionBudget" not in _kinds(off)


# --- the operator passes the pull secrets on --------------------------------------------


def _parse(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    add_operator_arguments(parser)
    return parser.parse_args(list(argv))


def test_pull_secret_flags_and_their_environment_default(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parse("--image-pull-secret", "a", "--image-pull-secret", "b")
    assert args.image_pull_secret == ["a", "b"]
    monkeypatch.setenv("KVRELAY_IMAGE_PULL_SECRETS", "x,y")
    assert _parse().image_pull_secret == ["x", "y"]
    monkeypatch.delenv("KVRELAY_IMAGE_PULL_SECRETS")
    assert _parse().image_pull_secret == []


def test_every_service_pod_gets_the_operators_pull_secrets() -> None:
    body = service_body(
        {
            "imagePullSecrets": [{"name": "own"}, {"name": "regcred"}],
            "model": {"cache": {"shared": True}},
        }
    )
    merged = with_operator_pull_secrets(body, ("regcred", "mirror"))
    assert body["spec"]["imagePullSecrets"] == [{"name": "own"}, {"name": "regcred"}]  # a copy
    spec = parse_service(merged, IMAGE)
    objects = desired_objects(spec, {"prefill": None, "decode": None})
    pods = []
    for obj in objects:
        if obj["kind"] == "RayCluster":
            groups = [obj["spec"]["headGroupSpec"], *obj["spec"]["workerGroupSpecs"]]
            pods += [g["template"]["spec"] for g in groups]
        elif obj["kind"] in ("Deployment", "Job"):
            pods.append(obj["spec"]["template"]["spec"])
    assert len(pods) == 5  # head, prefill, decode, router, the model cache Job
    for pod in pods:
        names = [ref["name"] for ref in pod["imagePullSecrets"]]
        assert names == ["own", "regcred", "mirror"]
    assert with_operator_pull_secrets(body, ()) is body


def test_the_handlers_reconcile_with_the_operators_pull_secrets() -> None:
    """Through the kopf handler's path (not the helper alone), against the fake API."""
    from kvrelay_operator.handlers import OperatorState, _reconcile
    from kvrelay_operator.metrics import OperatorMetrics
    from tests.operator.fake_api import fake_api

    with fake_api() as (fake, kube):
        svc = "/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/demo"
        fake.put(svc, service_body({}))
        state = OperatorState(
            kube=kube,
            default_image=IMAGE,
            metrics=OperatorMetrics(),
            router_url=lambda _: "http://127.0.0.1:9",
            pull_secrets=("regcred",),
        )
        _reconcile(fake.objects[svc], state)
        deployment = next(
            r.body for r in fake.applied() if re.search(r"/deployments/demo-router$", r.path)
        )
    pod = deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
