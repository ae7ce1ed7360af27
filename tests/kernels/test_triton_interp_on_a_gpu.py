"""tests/kernels/triton_interp turns Triton into its interpreter for the whole pytest session.
On a GPU machine `pytest tests/kernels -k gpu` collects that folder too (then deselects it):
the GPU tests' Triton kernels must stay compiled there, and the folder's own tests skip.

Each case runs pytest's collection in a fresh process (the variable is read once, when triton
is imported), once as this machine is and once with `torch.cuda.is_available` answering True
before the folder's conftest is loaded; a plugin records what the session ended up with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
INTERP_TESTS = "tests/kernels/triton_interp/test_triton_split.py"

PLUGIN = """
import json, os
import torch

if os.environ["PROBE_GPU"] == "1":
    torch.cuda.is_available = lambda: True


def pytest_collection_finish(session):
    skips = [m.kwargs.get("reason", "") for item in session.items
             for m in item.iter_markers("skip")]
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"interpret": os.environ.get("TRITON_INTERPRET"),
                   "items": len(session.items), "skips": skips}, f)
"""


def collect(tmp_path: Path, gpu: bool) -> dict[str, Any]:
    (tmp_path / "probe_plugin.py").write_text(PLUGIN)
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(tmp_path), str(ROOT / "services"), str(ROOT / "kernels"), str(ROOT)]
    env |= {"PROBE_GPU": "1" if gpu else "0", "PROBE_OUT": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    command = [sys.executable, "-m", "pytest", "-p", "probe_plugin", "--collect-only", "-q"]
    command += ["-p", "no:cacheprovider", "-p", "no:xdist", INTERP_TESTS]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_on_a_gpu_the_interpreter_folder_skips_and_leaves_triton_compiled(tmp_path: Path) -> None:
    probe = collect(tmp_path, gpu=True)
    assert probe["interpret"] is None
    assert probe["items"] > 0
    assert len(probe["skips"]) == probe["items"]
    assert all("a GPU is here" in reason for reason in probe["skips"])


def test_on_a_cpu_the_interpreter_folder_runs_its_tests_interpreted(tmp_path: Path) -> None:
    probe = collect(tmp_path, gpu=False)
    assert probe["interpret"] == "1"
    assert probe["items"] > 0
    assert probe["skips"] == []
