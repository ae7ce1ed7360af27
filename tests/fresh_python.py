"""Run code in a fresh Python process (what a test must see before any import of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO_ROOT


def run_fresh_python(code: str, *packages: str, timeout: float = 120) -> str:
    """stdout of `code` (dedented) run by this interpreter, with REPO_ROOT/<package> for each
    of `packages` and the repository root on its path; asserts it exits 0."""
    paths = [str(REPO_ROOT / package) for package in packages] + [str(REPO_ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
