"""A worker bounds oneDNN's shape-keyed caches (issue 13: the prefill worker's RSS grew ~2 MiB with
each new prompt length, because oneDNN and ideep kept 1024 matmul primitives each).

Measured in a fresh process each (the caches read their capacity once, at the first matmul):
the packed linears of the default model's shapes over 200 row counts, as a prefill worker sees
them, with glibc's bytes in use (mallinfo2) before and after."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.engine.args import EngineArgs
from kvrelay.worker.engine_builder import (
    BOUNDED_CACHE_ENV,
    bound_onednn_caches,
    build_worker_engine,
)

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, json, sys, torch
if sys.argv[1] == "bounded":
    from kvrelay.worker.engine_builder import bound_onednn_caches
    bound_onednn_caches()
from kvrelay.models.layers import PackedLinear

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
torch.set_num_threads(1)
# SmolLM2-135M's linears: qkv, o, gate_up, down ([out, in])
layers = [PackedLinear(torch.randn(o, i), None) for o, i in ((960, 576), (576, 576),
          (3072, 576), (576, 1536))]
def run(rows):
    with torch.inference_mode():
        for m in rows:
            for layer in layers:
                layer.forward(torch.randn(m, layer.in_features))
run(range(2, 6))
before = libc.mallinfo2().uordblks
run(range(6, 206))
print(json.dumps((libc.mallinfo2().uordblks - before) / 2**20))
"""


def in_use_growth_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in BOUNDED_CACHE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "services"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or ctypes.util.find_library("c") != "libc.so.6",
    reason="needs torch with oneDNN on glibc",
)
def test_bounded_caches_stop_the_growth_with_new_row_counts() -> None:
    unbounded = in_use_growth_mib("default")
    bounded = in_use_growth_mib("bounded")
    # Unbounded: ~0.3 MiB per (linear, row count) kept, ~250 MiB here; bounded: 64 entries.
    assert unbounded > 100, unbounded
    assert bounded < 40, (bounded, unbounded)


def test_an_operator_setting_wins() -> None:
    environ = {"LRU_CACHE_CAPACITY": "512"}
    bound_onednn_caches(environ)
    assert environ == {"LRU_CACHE_CAPACITY": "512", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def test_a_worker_engine_is_built_with_bounded_caches(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in BOUNDED_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    build_worker_engine(EngineArgs(model=str(tiny_llama_dir), num_blocks=16, block_size=4))
    for name, value in BOUNDED_CACHE_ENV.items():
        assert os.environ[name] == value
