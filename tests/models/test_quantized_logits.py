"""The vocab projection on the GGUF's own token-embedding blocks (fp32, tied embeddings): a
tiny Llama with Q4_1 layers and a Q8_0 embedding, as the default model's GGUF is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models.test_quantized import _LAYER_SHAPES, Q4_1, Q8_0, _forward_logits, make_gguf_folder

from kvrelay.models import load_model
from kvrelay.models.layers import linear
from kvrelay.models.llama import QUANTIZED_LOGITS_BELOW_ROWS
from kvrelay.models.quantized import Q8_0Linear
from kvrelay_kernels import select_backend


@pytest.fixture(scope="module")
def q8_0_embedding_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    layers = {name: Q4_1 for name in _LAYER_SHAPES}
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_q8_0_embd"), layers, default=Q8_0)


def _load(folder: Path, dtype: torch.dtype, quantization: str = "q4_1") -> Any:
    model, _ = load_model(folder, select_backend("auto"), dtype=dtype, quantization=quantization)
    return model


def test_few_rows_read_the_embedding_blocks_and_agree_with_the_dense_weight(
    q8_0_embedding_folder: Path, paged_kv: Any
) -> None:
    model = _load(q8_0_embedding_folder, torch.float32)
    if model.quantized_logits is None:
        pytest.skip("the CPU block kernel did not build here")
    assert isinstance(model.quantized_logits, Q8_0Linear)
    assert model.quantized_logits.blocks_for_few_rows  # no int4 planes were made for it
    weight = model.embed_tokens.weight
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, QUANTIZED_LOGITS_BELOW_ROWS - 1, QUANTIZED_LOGITS_BELOW_ROWS):
        hidden = torch.randn(rows, weight.shape[1], generator=gen)
        with torch.inference_mode():
            got = model.compute_logits(hidden)
            blocks = model.quantized_logits(hidden)
        assert got.shape == (rows, weight.shape[0]) and got.dtype == torch.float32
        dense = linear(hidden, weight)
        # The blocks are the embedding's exact weights: only the order of the sums differs.
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
        if rows < QUANTIZED_LOGITS_BELOW_ROWS:
            assert torch.equal(got, blocks)  # the block loop made these
    # And the whole model still gives its dequantized twin's logits.
    twin = _load(q8_0_embedding_folder, torch.float32, "none")
    ids = [5, 17, 99, 3]
    expected = _forward_logits(twin, paged_kv, ids)
    got = _forward_logits(model, paged_kv, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bf16_and_unquantized_embeddings_keep_the_dense_projection(
    q8_0_embedding_folder: Path, tmp_path: Path
) -> None:
    assert _load(q8_0_embedding_folder, torch.bfloat16).quantized_logits is None
    assert _load(q8_0_embedding_folder, torch.float32, "none").quantized_logits is None
    f32_embedding = make_gguf_folder(tmp_path)  # Q4_1 layers, an F32 token embedding
    assert _load(f32_embedding, torch.float32).quantized_logits is None


def test_the_torch_only_kernel_choice_keeps_the_dense_projection(
    q8_0_embedding_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_CPU_QUANT_KERNEL", "torch")  # torch's int4 fp32: ~20x slower
    assert _load(q8_0_embedding_folder, torch.float32).quantized_logits is None
