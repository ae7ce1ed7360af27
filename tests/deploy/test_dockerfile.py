"""The image recipe (no Docker engine here): what every pod relies on is in it."""

from __future__ import annotations

import re

from tests.deploy.schemas import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORED = (ROOT / ".dockerignore").read_text().split()


def _final_stage() -> str:
    return DOCKERFILE.rsplit("\nFROM ", 1)[1]


def test_runs_as_the_uid_the_pods_expect() -> None:
    from kvrelay_operator.podparts import RUN_AS_USER

    assert f"USER {RUN_AS_USER}:{RUN_AS_USER}" in _final_stage()
    assert f"--uid {RUN_AS_USER}" in _final_stage()


def test_installs_the_project_with_its_pins() -> None:
    # Dependencies come from pyproject.toml itself, so torch==2.13.0 and ray==2.60.0 hold.
    assert 'tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]' in DOCKERFILE
    assert "pip install -q --no-deps ." in DOCKERFILE
    assert not re.search(r"\btorch[=<>]", DOCKERFILE.replace("torch==2.13.0", ""))
    for folder in ("services", "kernels", "operators", "proto"):
        assert f"COPY {folder} ./{folder}" in DOCKERFILE


def test_has_what_kuberay_and_the_engine_need_at_run_time() -> None:
    final = _final_stage()
    assert "wget" in final  # KubeRay's Ray pod probes
    assert "KVRELAY_CACHE_DIR=/var/cache/kvrelay" in final
    assert "EXPOSE 8000 50051" in final


def test_build_context_leaves_out_local_state() -> None:
    for path in (".git", ".venv", "tests", "**/__pycache__"):
        assert path in IGNORED
    for needed in ("services", "kernels", "operators", "proto", "pyproject.toml", "README.md"):
        assert needed not in IGNORED
