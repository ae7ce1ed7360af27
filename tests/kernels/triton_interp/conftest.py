"""Triton kernels on the CPU: TRITON_INTERPRET=1 must be set before triton is imported (it is
read when kernels are decorated), so it is set here, when pytest first enters this folder.

Only on a machine without a GPU. The variable holds for the whole pytest session, and this
folder is collected (then deselected) by `pytest tests/kernels -k gpu` too: on a GPU it would
turn the GPU tests' Triton kernels into interpreted ones (slow, and failing under the GPU
image's Triton 3.6 with numpy 2.5). There this folder's tests skip instead; the GPU tests run
the kernels compiled.

Nothing outside this folder runs Triton kernels on a CPU, and the backend selection offers
`triton` on a CPU only by name. If triton was imported earlier without the interpreter on a
CPU-only machine, these tests fail, naming the cause, so a module that imports triton at import
time cannot silently turn them off.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

_GPU_HERE = torch.cuda.is_available()
_ALREADY_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _GPU_HERE:
    os.environ["TRITON_INTERPRET"] = "1"


_TOO_EARLY = (
    "triton was imported before TRITON_INTERPRET=1 could be set: a test module collected "
    "before tests/kernels/triton_interp imports triton (directly or through kvrelay_kernels."
    "triton_attention / triton_write_kv) at import time; import it inside the function"
)


_ON_A_GPU = (
    "a GPU is here: the Triton kernels run compiled in tests/kernels/test_gpu_*.py, and this "
    "folder's interpreter (TRITON_INTERPRET=1 for the whole session) would turn those into "
    "interpreted ones"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("triton") is None:
        marker = pytest.mark.skip(reason="triton is not installed")
    elif _GPU_HERE:
        marker = pytest.mark.skip(reason=_ON_A_GPU)
    else:
        return
    for item in items:
        if "triton_interp" in str(item.path):
            item.add_marker(marker)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a CPU-only machine an early import is a defect of the suite: fail, do not skip."""
    if _ALREADY_COMPILED and not _GPU_HERE and "triton_interp" in str(item.path):
        pytest.fail(_TOO_EARLY)
