"""The image recipe (no Docker engine here): what every pod relies on is in it. The
Dockerfile is parsed into stages and each stage's instructions are checked."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.schemas import CHART, ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORED = [
    line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")
]
BUILD_SCRIPT = ROOT / "deploy" / "docker" / "build_cuda_kernels.py"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name (or "final" for the last, unnamed one) -> its instructions, FROM first."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in _instructions(DOCKERFILE):
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else "final"
            current = stages.setdefault(name, [])
        if current is not None:
            current.append((word, rest))
    return stages


def _text(stage: str) -> str:
    return "\n".join(f"{w} {r}" for w, r in _stages()[stage])


def test_stages_chain_build_kernels_and_a_slim_final_image() -> None:
    stages = _stages()
    assert list(stages) == [
        "cuda-toolkit",
        "build",
        "kernels-cuda",
        "kernels-cpu",
        "kernels",
        "operator",  # --target operator (test_operator_image.py); never the default build
        "final",
    ]
    assert stages["cuda-toolkit"][0][1].startswith("nvidia/cuda:${CUDA_VERSION}-devel-")
    assert stages["kernels-cuda"][0][1] == "build AS kernels-cuda"
    assert stages["kernels"][0][1] == "kernels-${KERNELS} AS kernels"
    # The final image is built from the slim Python base and takes the venv from `kernels`.
    final = _text("final")
    assert "FROM python:${PYTHON_VERSION}-slim-bookworm" in final
    assert "COPY --from=kernels /opt/kvrelay /opt/kvrelay" in final
    assert "cuda-toolkit" not in final  # no toolkit in the image


def test_a_cpu_image_stays_possible() -> None:
    args = dict(
        rest.split("=", 1)
        for word, rest in _instructions(DOCKERFILE)
        if word == "ARG" and "=" in rest
    )
    assert args["KERNELS"] == "cuda"
    # The build stage plus the CPU kernels built in (test_operator_image.py).
    assert _stages()["kernels-cpu"][0] == ("FROM", "build AS kernels-cpu")
    assert "PIP_EXTRA_INDEX_URL" in _text("build")


def test_installs_the_cluster_extra_ray_default() -> None:
    """Defect 1: plain ray has no dashboard agent, so KubeRay's probes never pass."""
    build = _text("build")
    assert 'p["optional-dependencies"]["cluster"]' in build
    assert 'pip install -q --no-deps ".[cluster]"' in build
    assert "import aiohttp_cors, ray.dashboard.modules" in build
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (cluster,) = pyproject["project"]["optional-dependencies"]["cluster"]
    assert cluster.startswith("ray[default]==")


def test_the_ray_version_the_operator_states_is_the_images() -> None:
    """Defect 1, raycluster side: KubeRay picks its probes by spec.rayVersion, which must be
    the Ray the image installs; the head keeps its dashboard (the probes call it)."""
    from kvrelay_operator.desired import desired_objects
    from kvrelay_operator.spec import ServiceSpec
    from tests.operator.services import service

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (cluster,) = pyproject["project"]["optional-dependencies"]["cluster"]
    version = cluster.split("==")[1]
    assert (
        ServiceSpec(name="x", namespace="y", uid="", generation=0, image="i").ray_version == version
    )
    objects = desired_objects(service({}), {"prefill": None, "decode": None})
    ray = next(o for o in objects if o["kind"] == "RayCluster")
    assert ray["spec"]["rayVersion"] == version
    head = ray["spec"]["headGroupSpec"]["rayStartParams"]
    assert head.get("include-dashboard", "true") != "false"
    assert "dashboard-agent-listen-port" not in head  # the probes expect the default, 52365


def test_cuda_stage_builds_the_kernels_ahead_of_time() -> None:
    """Defect 8: the CUDA kernels reach the image, compiled in a CUDA stage."""
    stage = _text("kernels-cuda")
    assert "COPY --from=cuda-toolkit /opt/cuda-toolkit /usr/local/cuda" in stage
    assert "CUDA_HOME=/usr/local/cuda" in stage
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in stage
    assert "COPY deploy/docker/build_cuda_kernels.py /tmp/build_cuda_kernels.py" in stage
    assert "python /tmp/build_cuda_kernels.py" in stage
    assert "import torch, kvrelay_cuda_kernels" in stage  # the build is checked by importing it
    assert "torch.version.cuda" in stage  # a toolkit that does not match torch fails early


def test_the_build_script_builds_the_module_the_loader_names() -> None:
    from kvrelay_kernels import cuda_backend

    tree = ast.parse(BUILD_SCRIPT.read_text())
    module = next(
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "MODULE"
    )
    assert module == cuda_backend._NAME
    text = BUILD_SCRIPT.read_text()
    assert "cuda_backend.sources()" in text and "CUDAExtension" in text


def test_the_build_script_refuses_without_target_architectures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_cuda_kernels", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert script.main([str(tmp_path)]) == 2


def test_runs_as_the_uid_the_pods_expect() -> None:
    from kvrelay_operator.podparts import RUN_AS_USER

    final = _text("final")
    assert f"USER {RUN_AS_USER}:{RUN_AS_USER}" in final
    assert f"--uid {RUN_AS_USER}" in final


def test_installs_the_project_with_its_pins() -> None:
    # Dependencies come from pyproject.toml itself, so torch==2.13.0 and ray==2.60.0 hold.
    assert 'tomllib.load(open("pyproject.toml", "rb"))["project"]' in DOCKERFILE
    assert not re.search(r"\btorch[=<>]", DOCKERFILE.replace("torch==2.13.0", ""))
    build = _text("build")
    for folder in ("services", "kernels", "operators", "proto"):
        assert f"COPY {folder} ./{folder}" in build
    # setup.py ships the CUDA sources inside the wheel (the JIT fallback reads them there).
    assert "COPY pyproject.toml README.md setup.py MANIFEST.in ./" in build


def test_every_port_the_pods_use_is_exposed_and_probes_can_run() -> None:
    from kvrelay_operator.names import GRPC_PORT, HTTP_PORT, RAY_CLIENT_PORT, RAY_GCS_PORT

    final = _text("final")
    (exposed,) = [r for w, r in _stages()["final"] if w == "EXPOSE"]
    ports = {int(p) for p in exposed.split()}
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    assert ports >= {HTTP_PORT, GRPC_PORT, RAY_CLIENT_PORT, RAY_GCS_PORT}
    assert ports >= {values["probePort"], values["metricsPort"]}
    assert ports >= {8265, 52365}  # the Ray dashboard and its agent: KubeRay's probes
    assert "wget" in final  # KubeRay's probes of Ray pods run wget in the container
    assert "KVRELAY_CACHE_DIR=/var/cache/kvrelay" in final
    # The operator's entry point is installed and answers (the chart runs it).
    assert "python -m kvrelay_operator --help" in _text("build")


def test_build_context_leaves_out_local_state_but_not_the_build_script() -> None:
    for path in (".git", ".venv", "tests", "**/__pycache__", "deploy/helm"):
        assert path in IGNORED
    for needed in (
        "services",
        "kernels",
        "operators",
        "proto",
        "pyproject.toml",
        "README.md",
        "setup.py",
        "deploy",
        "deploy/docker",
    ):
        assert needed not in IGNORED
