"""`--quantization` and `--dtype auto` through the engine's arguments.

Skipped until the engine patch of issue 15 (EngineArgs.quantization, resolve_dtype using
cpu_has_native_bf16) lands in kvrelay.engine; then these run as they are.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.device import resolve_dtype
from kvrelay.models.cpu_features import cpu_has_native_bf16
from kvrelay.models.quantized import Int4Linear

pytestmark = pytest.mark.skipif(
    "quantization" not in {f.name for f in dataclasses.fields(EngineArgs)},
    reason="EngineArgs has no quantization field yet (engine patch of issue 15 not applied)",
)


def test_dtype_auto_follows_native_bf16_on_cpu() -> None:
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("float32", "cpu") == "float32"


@pytest.mark.slow
def test_llm_with_q4_1_runs_int4_layers_and_answers() -> None:
    from kvrelay import SamplingParams
    from kvrelay.llm import LLM

    llm = LLM(quantization="q4_1", dtype="float32")
    model = llm.engine.runner.model
    assert any(isinstance(m, Int4Linear) for m in model.modules())  # type: ignore[union-attr]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    text = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
