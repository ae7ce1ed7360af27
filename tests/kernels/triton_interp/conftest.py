"""Triton kernels on the CPU: TRITON_INTERPRET=1 must be set before triton is imported (it is
read when kernels are decorated), so it is set here, when pytest first enters this folder.

Only this folder's tests import triton; nothing else in the suite runs Triton kernels, and the
backend selection offers `triton` on a CPU only by name. If triton was imported earlier
without the interpreter, these tests skip rather than try to launch on a missing GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_ALREADY_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = None
    if importlib.util.find_spec("triton") is None:
        reason = "triton is not installed"
    elif _ALREADY_COMPILED:
        reason = "triton was imported before TRITON_INTERPRET=1 could be set"
    if reason is None:
        return
    for item in items:
        if "triton_interp" in str(item.path):
            item.add_marker(pytest.mark.skip(reason=reason))
