"""Small venvs holding exact package versions from PyPI, cached under ~/.cache/kvrelay and named
by those versions, for the tests of the committed kvrelay/v1 code: the generator (grpcio-tools
at pyproject's grpcio floor, the same folder `make proto` builds) and the oldest grpcio +
protobuf that pyproject allows. They stay outside the project's .venv because their pins
(protobuf 5) would replace its newer packages there.

The first run downloads and installs (tens of seconds); later runs find the folder's stamp and
cost nothing. A test is skipped only when the package index cannot be reached at all; a pip
failure with a reachable index (a version that does not exist, no wheel for this Python) fails.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "kvrelay"
STAMP = ".installed"  # written last, as the Makefile's `proto` target does
DEFAULT_INDEX = "https://pypi.org/simple/"


def makefile_grpc_tools_version() -> str:
    """The grpcio-tools version `make proto` generates with (the Makefile's GRPC_TOOLS_VERSION)."""
    text = (REPO_ROOT / "Makefile").read_text()
    found = re.search(r"^GRPC_TOOLS_VERSION\s*:=\s*(\S+)\s*$", text, re.MULTILINE)
    assert found, "the Makefile has no GRPC_TOOLS_VERSION"
    return found.group(1)


def grpc_tools_python() -> Path:
    """The Python of the venv `make proto` uses: grpcio-tools at the Makefile's version."""
    version = makefile_grpc_tools_version()
    return pinned_python(f"grpc-tools-{version}", [f"grpcio-tools=={version}"])


def pinned_python(name: str, requirements: Sequence[str]) -> Path:
    """The Python of venv CACHE/`name` with exactly `requirements` (binary wheels only),
    created on first use. Concurrent callers wait on a lock file rather than race the pip run."""
    venv = CACHE / name
    python = venv / "bin" / "python"
    if (venv / STAMP).exists():
        return python
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / STAMP).exists():  # another process built it while this one waited
            return python
        shutil.rmtree(venv, ignore_errors=True)  # a half-built one from an interrupted run
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        install = [str(python), "-m", "pip", "install", "-q", "--only-binary=:all:"]
        done = subprocess.run([*install, *requirements], capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            unreachable = index_unreachable()
            if unreachable is not None:
                pytest.skip(f"cannot install {' '.join(requirements)}: {unreachable}")
            pytest.fail(f"pip install {' '.join(requirements)} failed:\n{done.stderr[-3000:]}")
        (venv / STAMP).touch()
    return python


def index_unreachable() -> str | None:
    """Why pip's package index cannot be reached from here, or None when it answers."""
    index = os.environ.get("PIP_INDEX_URL") or configured_index() or DEFAULT_INDEX
    try:
        with urllib.request.urlopen(index, timeout=15):
            return None
    except urllib.error.HTTPError:
        return None  # it answered, if with an error: pip's own failure is the real one
    except OSError as exc:  # DNS, refused, timeout, no route
        return f"the package index {index} cannot be reached ({exc})"


def configured_index() -> str | None:
    """The index-url of pip's configuration files, if one is set there."""
    asked = [sys.executable, "-m", "pip", "config", "get", "global.index-url"]
    done = subprocess.run(asked, capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None
