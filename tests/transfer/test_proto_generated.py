"""The committed kvrelay.v1 Python code is what `make proto` generates from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py")


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
            str(REPO_ROOT / "proto/kvrelay/v1/kv_transfer.proto"),
        ],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "kvrelay/v1" / name).read_text()
        committed = (REPO_ROOT / "services/kvrelay/v1" / name).read_text()
        assert fresh == committed, f"services/kvrelay/v1/{name} is stale: run `make proto`"
