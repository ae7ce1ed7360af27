"""One Python floor everywhere: pyproject, the linters, the Dockerfile, the Makefile's check."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLOOR = (3, 11)  # enum.StrEnum, asyncio.timeout, asyncio.Runner, tomllib


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_and_linters_say_the_same_floor() -> None:
    project = _pyproject()
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert project["tool"]["mypy"]["python_version"] == "3.11"


def test_the_image_uses_a_python_at_or_above_the_floor() -> None:
    match = re.search(r"^ARG PYTHON_VERSION=(\d+)\.(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match is not None
    assert (int(match[1]), int(match[2])) >= FLOOR


def test_make_refuses_an_older_python_in_one_line(tmp_path: Path) -> None:
    # A stand-in "python" that reports 3.10: the Makefile's check must stop before any venv.
    fake = tmp_path / "python3.10"
    fake.write_text(
        "#!/bin/sh\n"
        f'exec {sys.executable} -c "import sys; sys.version_info = (3, 10, 0); '
        'sys.version = \'3.10.0\'; exec(sys.argv[1])" "$2"\n'
    )
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    run = subprocess.run(
        ["make", "-s", f"PYTHON={fake}", f"VENV={venv}", f"{venv}/bin/python"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "kvrelay needs Python 3.11 or newer" in run.stderr
    assert "make PYTHON=python3.11" in run.stderr
    assert not venv.exists()


def test_make_accepts_this_python(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run = subprocess.run(
        ["make", "-s", "-n", f"PYTHON={sys.executable}", f"VENV={venv}", f"{venv}/bin/python"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "-m venv" in run.stdout
