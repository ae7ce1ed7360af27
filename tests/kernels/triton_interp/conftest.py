"""Triton kernels on the CPU: TRITON_INTERPRET=1 must be set before triton is imported (it is
read when kernels are decorated), so it is set here, when pytest first enters this folder.

Only this folder's tests import triton; nothing else in the suite runs Triton kernels, and the
backend selection offers `triton` on a CPU only by name. If triton was imported earlier
without the interpreter, these tests cannot run: on a GPU machine they skip (the GPU tests run
the kernels compiled), and on a CPU-only one they fail, naming the cause, so a module that
imports triton at import time cannot silently turn them off.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

_ALREADY_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


_TOO_EARLY = (
    "triton was imported before TRITON_INTERPRET=1 could be set: a test module collected "
    "before tests/kernels/triton_interp imports triton (directly or through kvrelay_kernels."
    "triton_attention / triton_write_kv) at import time; import it inside the function"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("triton") is None:
        marker = pytest.mark.skip(reason="triton is not installed")
    elif _ALREADY_COMPILED and torch.cuda.is_available():
        marker = pytest.mark.skip(reason=_TOO_EARLY)
    else:
        return
    for item in items:
        if "triton_interp" in str(item.path):
            item.add_marker(marker)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a CPU-only machine an early import is a defect of the suite: fail, do not skip."""
    if _ALREADY_COMPILED and not torch.cuda.is_available() and "triton_interp" in str(item.path):
        pytest.fail(_TOO_EARLY)
