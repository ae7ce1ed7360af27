"""The new families' CUDA code paths on a CPU-only machine (tests/fake_cuda/family_scenarios.py,
run once in a process of its own): Qwen3's q/k norms on the `cuda` backend with graphs and
eagerly, never through the fused rope+KV-write launch; Gemma 2's and Gemma 3's windows and
caps on the auto backend (run or refused by its capability), Gemma 3 on the `torch` backend
on the device. Every step runs
under issue 14's rules (no device read but the sampled ids, no blocking copy)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fake_cuda.report import run_scenarios
from tests.fake_cuda.scenarios import finished_run

pytestmark = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch (GPU tests cover it)"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenarios(
        "tests.fake_cuda.family_scenarios",
        tmp_path_factory.mktemp("fake-cuda-families") / "report.json",
    )


def kernels_run(result: dict[str, Any]) -> set[str]:
    return {name for step in result["steps"] for name, _ in step}


@pytest.mark.parametrize("name", ["qwen3_graphs", "qwen3_eager"])
def test_qwen3_norms_q_and_k_before_rope_on_the_cuda_backend(
    report: dict[str, Any], name: str
) -> None:
    result = finished_run(report, name)
    assert result["backend"] == "cuda" and result["graphs"] is (name == "qwen3_graphs")
    launched = kernels_run(result)
    # The fused launch rotates q/k as they leave qkv_proj, before any norm: it must not run.
    assert "rope_and_write_kv" not in launched
    # Rotated after the norms (rms_norm launches on the heads), written by the backend, and
    # attended by the decode kernel beside Triton's prefill chunks.
    assert {"rms_norm", "write_kv", "decode", "triton"} <= launched


@pytest.mark.parametrize("name", ["gemma2_auto", "gemma3_auto"])
def test_gemma_on_the_auto_cuda_backend_runs_or_is_refused_by_capability(
    report: dict[str, Any], name: str
) -> None:
    part = report[name]
    if "result" in part and not part["result"]["claims_window"]:
        assert "sliding-window" in part["result"]["refused"]
        assert "'torch'" in part["result"]["refused"]  # what to use instead
        return
    result = finished_run(report, name)
    assert result["backend"] == "cuda" and result["graphs"] and "refused" not in result
    launched = kernels_run(result)
    assert {"decode", "triton"} <= launched
    # Gemma 2 has no q/k norms: its q/k take the fused rope+KV-write launch; Gemma 3's
    # norms keep them off it.
    assert ("rope_and_write_kv" in launched) is (name == "gemma2_auto")


def test_gemma3_runs_on_the_device_through_the_torch_backend(report: dict[str, Any]) -> None:
    result = finished_run(report, "gemma3_torch")
    assert result["backend"] == "torch" and not result["graphs"]  # graphs need 'cuda'
