"""Run one fake-CUDA scenario module in a process of its own and read back its JSON report.

The rig changes process-wide state (see this package's docstring), so each test module that
drives scenarios starts them through `run_scenarios` instead of importing them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_scenarios(module: str, out: Path, timeout_s: float = 900) -> dict[str, Any]:
    """`python -m <module> <out>` from the repository root; its report, after checking that
    the process exited cleanly (its stderr's tail is the failure message otherwise)."""
    done = subprocess.run(
        [sys.executable, "-m", module, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded
