"""benchmarks/blocked_matmul.py and benchmarks/huge_pages.py, and the decode-step timer they
share with step_overhead.py (benchmarks/serving/decode_steps.py), on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.llm import LLM
from kvrelay.models.layers import Linear
from kvrelay_kernels.host_memory import HUGE_PAGES_ENV
from tests.benchmarks.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def decode_steps() -> ModuleType:
    return load_script(BENCHMARKS / "serving" / "decode_steps.py")


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("blocked_matmul.py", ("--dtypes", "--rounds", "--tokens", "--skip-decode")),
        ("huge_pages.py", ("--configs", "--rounds", "--tokens", "--threads")),
    ],
)
def test_help_names_the_options(name: str, flags: tuple[str, ...]) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), "--help"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert all(flag in out.stdout for flag in flags)


def test_decode_steps_are_timed_and_the_pool_is_whole_after(
    llm: LLM, decode_steps: ModuleType
) -> None:
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ms = decode_steps.decode_step_ms(engine, prompt, params, "timed", streams=2)
    assert 0.01 < ms < 60_000
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.num_blocks
    with pytest.raises(ValueError, match="more than one token"):
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        decode_steps.decode_step_ms(engine, prompt, one, "one")
    assert engine.kv_cache.num_free_blocks == engine.num_blocks


def test_huge_pages_builds_each_layout_and_puts_everything_back() -> None:
    script = load_script(BENCHMARKS / "huge_pages.py")
    import kvrelay.models.loader as loader

    assert script.engine_args("bfloat16:q4_1:int8") == {
        "dtype": "bfloat16", "kv_cache_memory": "256MiB", "quantization": "q4_1",
        "int8_activations": True,
    }  # fmt: skip
    assert script.engine_args("float32") == {"dtype": "float32", "kv_cache_memory": "256MiB"}
    gather, before = loader.gather_weights, os.environ.get(HUGE_PAGES_ENV)
    with script.layout("as loaded"):
        assert loader.gather_weights is not gather and loader.gather_weights(None) == 0
        assert os.environ[HUGE_PAGES_ENV] == "0"
    with script.layout("gathered 4K"):
        assert loader.gather_weights is gather and os.environ[HUGE_PAGES_ENV] == "0"
    with script.layout("gathered 2M"):
        assert loader.gather_weights is gather and os.environ[HUGE_PAGES_ENV] == "1"
    assert loader.gather_weights is gather and os.environ.get(HUGE_PAGES_ENV) == before


def test_blocked_matmul_runs_the_model_on_onednn_for_a_while(llm: LLM) -> None:
    script = load_script(BENCHMARKS / "blocked_matmul.py")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    bound = [(layer.blocked, layer.packed) for layer in layers]
    if bound[0][0] is None:
        pytest.skip("no fp32 blocked kernel in this build (no AVX-512)")
    onednn = script.onednn_copies(model)
    assert len(onednn) == len(layers) + (model.lm_head is None)
    assert "kvrelay blocked" in script.layer_paths(layers, onednn)
    hidden = torch.randn(3, model.embed_tokens.weight.shape[1])
    ours = model.compute_logits(hidden)
    with script.on_onednn(model, onednn):
        assert all(layer.blocked is None and layer.packed is not None for layer in layers)
        assert "kvrelay blocked" not in script.layer_paths(layers, onednn)
        torch.testing.assert_close(model.compute_logits(hidden), ours, rtol=1e-4, atol=1e-4)
    assert [(layer.blocked, layer.packed) for layer in layers] == bound
