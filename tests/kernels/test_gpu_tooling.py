"""The GPU check's Python parts and `make kernels-check`'s parser, exercised on the CPU so they
cannot rot between lent GPUs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["gpu_decode_bench.py", "gpu_engine_smoke.py"])
def test_benchmark_scripts_parse_their_arguments(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_decode_bench_plans_every_shape_and_checks_its_targets() -> None:
    bench = _load(ROOT / "benchmarks" / "gpu_decode_bench.py")
    planned = bench.shapes([1, 16, 64, 256], [512, 2048, 8192])
    assert len(planned) == 24
    llama = next(s for s in planned if s.model == "llama8b" and s.batch == 64 and s.context == 2048)
    assert llama.kv_bytes(2) == 2 * 64 * 2048 * 8 * 128 * 2
    # 1 GB/s of copy bandwidth; the kernel reads kv_bytes in `us` microseconds.
    slow = bench.Result(llama, us={"cuda": llama.kv_bytes(2) / 0.5e3, "flex": 1.0})
    assert slow.percent("cuda", 1.0, 2) == pytest.approx(50.0)
    misses = bench.check_targets([slow], 1.0, 2)
    assert len(misses) == 2  # under 70%, and slower than flex
    fast = bench.Result(llama, us={"cuda": llama.kv_bytes(2) / 0.9e3, "flex": 1e9})
    assert bench.check_targets([fast], 1.0, 2) == []
    assert "llama8b" in bench.format_table([slow, fast], 1.0, 2)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_paged_block_mask_maps_each_sequence_to_its_pages() -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    bench = _load(ROOT / "benchmarks" / "gpu_decode_bench.py")
    pages = torch.tensor([[3, 0], [1, 2]])
    mask = bench.paged_block_mask(pages, total_tokens=4 * 128, page=128)
    dense = mask.to_dense()  # [batch, 1, q blocks, kv blocks]
    assert dense[0, 0, 0].tolist() == [1, 0, 0, 1]
    assert dense[1, 0, 0].tolist() == [0, 1, 1, 0]
    # Flex (eager here) with that mask reads exactly each sequence's pages.
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(2, 4, 1, 16)
    k, v = torch.randn(1, 2, 4 * 128, 16), torch.randn(1, 2, 4 * 128, 16)
    out = flex_attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), block_mask=mask,
                         scale=0.25, enable_gqa=True)  # fmt: skip
    for seq in range(2):
        tokens = torch.cat([torch.arange(p * 128, (p + 1) * 128) for p in pages[seq].tolist()])
        ks = k[0][:, tokens].repeat_interleave(2, 0)
        vs = v[0][:, tokens].repeat_interleave(2, 0)
        expected = torch.softmax(q[seq] @ ks.transpose(-1, -2) * 0.25, -1) @ vs
        torch.testing.assert_close(out[seq], expected, atol=1e-5, rtol=1e-5)


PTXAS = """\
ptxas info    : Compiling entry function '_ZN7kvrelay3fooEv' for 'sm_90'
ptxas info    : Function properties for _ZN7kvrelay3fooEv
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 41568 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN7kvrelay3barEv' for 'sm_90'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 400 bytes cmem[0]
"""


def test_kernels_check_parses_ptxas_and_flags_spills(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    check = _load(ROOT / "kernels" / "csrc" / "check_kernels.py")

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=PTXAS)

    monkeypatch.setattr(check.subprocess, "run", fake_run)
    _, kernels, error = check.compile_one(tmp_path / "x.cu", "sm_90", tmp_path)
    assert error == ""
    assert [(k.registers, k.smem, k.spill) for k in kernels] == [(255, 41568, 12), (32, 0, 0)]
