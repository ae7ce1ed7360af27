"""Backend selection and the CUDA loader on this (GPU-less) machine: nothing is built, the
CPU backends are chosen, and the kernel sources ship where the JIT loader looks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvrelay_kernels import available_backends, cuda_backend, select_backend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_cuda_backend_is_unavailable_without_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build() -> None:
        raise AssertionError("the CUDA binding must not be built without CUDA")

    monkeypatch.setattr(cuda_backend, "_build", no_build)
    assert not cuda_backend.is_available()
    assert "cuda" not in available_backends()
    with pytest.raises(ValueError, match="not available"):
        select_backend("cuda")


def test_auto_keeps_the_cpu_backends_first() -> None:
    names = available_backends()
    assert names[0] in ("cpu", "torch")
    if "triton" in names:  # interpreted Triton is correct but slow: never ahead of torch
        assert names.index("torch") < names.index("triton")
    assert select_backend("auto").name == names[0]


def test_cuda_sources_are_found() -> None:
    names = {path.name for path in cuda_backend.sources()}
    assert {"torch_binding.cpp", "paged_decode.cu", "cache_ops.cu"} <= names
    assert all(path.is_file() for path in cuda_backend.sources())


def test_cuda_backend_on_cpu_tensors_is_the_reference() -> None:
    """An engine keeping its cache in host memory still works if `cuda` was chosen."""
    from kvrelay_kernels import reference
    from tests.kernels.paged_batch import make_paged_batch

    batch = make_paged_batch([9, 20], [1, 4], 4, 2, 3, 16, seed=3)
    args = (batch.query, batch.kv_cache, 1, batch.block_tables, batch.seq_lens)
    got = cuda_backend.paged_attention(*args, batch.query_start_loc, 0.25)
    expected = reference.paged_attention(*args, batch.query_start_loc, 0.25)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_a_prebuilt_binding_is_taken_before_any_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image installs the binding as `kvrelay_cuda_kernels` (its CUDA stage) and its pods
    have no nvcc: `_build` must import that module and never start torch's JIT compile."""
    assert cuda_backend.prebuilt() is None  # none installed here
    folder = tmp_path
    (folder / f"{cuda_backend._NAME}.py").write_text("PREBUILT = True\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, cuda_backend._NAME, raising=False)

    def no_compile(*_: object, **__: object) -> None:
        raise AssertionError("compiled although a prebuilt binding is installed")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compile)
    module = cuda_backend._build()
    assert module is not None and module.PREBUILT
    monkeypatch.delitem(sys.modules, cuda_backend._NAME, raising=False)
