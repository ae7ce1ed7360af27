"""The committed kvrelay.v1 Python code is what `make proto` generates from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("kv_transfer", "generation")
GENERATED = [
    f"{proto}{suffix}" for proto in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
]


def test_generated_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(REPO_ROOT / "proto"),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *(str(REPO_ROOT / f"proto/kvrelay/v1/{proto}.proto") for proto in PROTOS),
        ],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "kvrelay/v1" / name).read_text()
        committed = (REPO_ROOT / "services/kvrelay/v1" / name).read_text()
        assert fresh == committed, f"services/kvrelay/v1/{name} is stale: run `make proto`"
