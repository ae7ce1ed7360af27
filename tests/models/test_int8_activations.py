"""`int8_activations`: quantized layers whose few-row steps multiply int8-quantized inputs by
their GGUF blocks (kvrelay_kernels' int8 kernel), on a tiny Llama with Q4_1 layers and a Q8_0
token embedding (as the default model's GGUF is), through the loader and the engine's flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models.test_quantized import _LAYER_SHAPES, Q4_1, Q8_0, _forward_logits, make_gguf_folder

from kvrelay.engine.args import EngineArgs
from kvrelay.models import load_model
from kvrelay.models.gguf_blocks import QuantizedWeightError
from kvrelay.models.quantized import (
    DENSE_FROM_ROWS,
    QUANT_KERNEL_ENV,
    Int4PlanesLinear,
    quantized_linear,
)
from kvrelay.models.quantized_loading import QuantizationError
from kvrelay_kernels import select_backend
from kvrelay_kernels.cpu_quantized import load_int8_dot_ops


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    layers = {name: Q4_1 for name in _LAYER_SHAPES}
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_int8"), layers, default=Q8_0)


def _load(folder: Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    model, _ = load_model(folder, select_backend("auto"), dtype=dtype, **kwargs)
    return model


def _quantized_layers(model: Any) -> list[Int4PlanesLinear]:
    return [m for m in model.layers.modules() if isinstance(m, Int4PlanesLinear)]


def test_every_row_count_takes_the_int8_kernel(folder: Path) -> None:
    model = _load(folder, quantization="q4_1", int8_activations=True)
    exact = _load(folder, quantization="q4_1")
    layers, exact_layers = _quantized_layers(model), _quantized_layers(exact)
    assert len(layers) == 2 * 4 and all(layer.int8_ops is not None for layer in layers)
    assert all("int8 activations" in repr(layer) for layer in layers)
    ops = load_int8_dot_ops()
    assert ops is not None
    layer, twin = layers[2], exact_layers[2]  # layer 0's gate_up: [192, 64]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # Prefill chunks too: the int8 kernel beat the dequantized dense matmul at 512 rows.
        for rows in (1, 5, DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS, 3 * DENSE_FROM_ROWS):
            x = torch.randn(rows, layer.in_features, generator=gen)
            expected = ops.q4_1_int8_matmul(x, layer.codes, layer.d, layer.m, None)
            assert torch.equal(layer(x), expected)
            assert not torch.equal(layer(x), twin(x))  # the int8 rounding shows
            torch.testing.assert_close(layer(x), twin(x), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_stays_close_to_its_dequantized_twin(
    folder: Path, paged_kv: Any, dtype: torch.dtype
) -> None:
    model = _load(folder, dtype, quantization="q4_1", int8_activations=True)
    # The tied vocab projection of few rows reads the Q8_0 embedding's blocks in bf16 too.
    assert model.quantized_logits is not None and model.quantized_logits.int8_ops is not None
    twin = _load(folder, quantization="none")
    ids = [5, 17, 99, 3, 64, 12, 7, 100, 42, 8]
    got = _forward_logits(model, paged_kv, ids).float()
    expected = _forward_logits(twin, paged_kv, ids)
    spread = (expected.amax(-1) - expected.amin(-1)).min().item()
    assert (got - expected).abs().max().item() < 0.05 * spread
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.8


def test_the_vocab_projection_reads_the_embedding_blocks_at_every_row_count(
    folder: Path,
) -> None:
    model = _load(folder, torch.bfloat16, quantization="q4_1", int8_activations=True)
    model.prepack()
    assert model.packed_logits is None  # no dense packed copy of the embedding is kept
    hidden = torch.randn(3 * DENSE_FROM_ROWS, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = model.compute_logits(hidden.bfloat16())
        blocks = model.quantized_logits(hidden.bfloat16().float())
    assert got.dtype == torch.float32 and torch.equal(got, blocks)  # fp32 logits, not bf16


def test_refused_without_quantized_weights(folder: Path) -> None:
    with pytest.raises(QuantizationError, match="add --quantization"):
        _load(folder, int8_activations=True)
    with pytest.raises(QuantizationError, match="add --quantization"):
        _load(folder, quantization="none", int8_activations=True)


def test_refused_where_the_block_kernels_are_off(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(QUANT_KERNEL_ENV, "torch")
    with pytest.raises(QuantizationError, match="drop --int8-activations"):
        _load(folder, quantization="q4_1", int8_activations=True)
    raw = torch.zeros(16, 2 * 20, dtype=torch.uint8)  # a direct caller gets the layer's error
    with pytest.raises(QuantizedWeightError, match="int8 activations need"):
        quantized_linear(raw, 64, None, torch.float32, int8_activations=True)


def test_the_flag_reaches_the_engine_args() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).int8_activations is False
    flags = ["--quantization", "q4_1", "--int8-activations"]
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    assert args.int8_activations is True and args.quantization == "q4_1"
    action = next(a for a in parser._actions if a.dest == "int8_activations")
    assert "NOT exact" in (action.help or "")


@pytest.mark.slow
def test_llm_with_int8_activations_answers() -> None:
    from kvrelay import SamplingParams
    from kvrelay.llm import LLM

    llm = LLM(quantization="q4_1", dtype="float32", int8_activations=True)
    model = llm.engine.runner.model
    assert all(layer.int8_ops is not None for layer in _quantized_layers(model))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    text = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
