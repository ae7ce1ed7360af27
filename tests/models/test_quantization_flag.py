"""`--quantization` through the engine's arguments: the CLI flag, and the default model served
with its Q4_1 weights kept 4-bit."""

from __future__ import annotations

import argparse

import pytest

from kvrelay.engine.args import EngineArgs
from kvrelay.models.quantized import Int4Linear


def test_the_cli_offers_what_the_loader_accepts() -> None:
    # args.py lists the choices itself (the CLI's flags import no torch): keep them in step.
    from kvrelay.models.quantized_loading import QUANTIZATIONS

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    action = next(a for a in parser._actions if a.dest == "quantization")
    assert tuple(action.choices or ()) == QUANTIZATIONS
    assert "q8_0" in (action.help or "")


def test_the_flag_reaches_the_engine_args() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization == "none"
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "q4_1"]))
    assert args.quantization == "q4_1"
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "q8_0"]))
    assert args.quantization == "q8_0"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--quantization", "q3_k"])


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
