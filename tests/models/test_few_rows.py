"""Linear and the tied vocab projection on kvrelay's few-row dense kernel (kvrelay_kernels.
cpu_dense): the rows it takes, the rows it leaves to oneDNN, and its binding to the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models.test_quantized import make_gguf_folder

from kvrelay.models import load_model
from kvrelay.models.layers import Linear, PackedLinear
from kvrelay.models.weight_arena import gather_weights
from kvrelay_kernels import select_backend
from kvrelay_kernels.cpu_dense import GEMV_MAX_ROWS, dense_gemv_for


def _kernel_for(dtype: torch.dtype) -> Any:
    module = dense_gemv_for(torch.empty(4, 64, dtype=dtype))
    if module is None:
        pytest.skip(f"no few-row kernel for {dtype} in this build (no AVX-512 / AVX512-BF16)")
    return module


def _prepacked(dtype: torch.dtype, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(128, 72, bias=bias).to(dtype)
    layer.requires_grad_(False)
    layer.prepack()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_take_the_kernel_and_more_rows_do_not(dtype: torch.dtype) -> None:
    ops = _kernel_for(dtype)
    layer = _prepacked(dtype)
    assert layer.few_rows is not None
    most = GEMV_MAX_ROWS[dtype]
    for rows in (1, 2, most):
        x = torch.randn(rows, 128).to(dtype)
        assert torch.equal(layer(x), ops.dense_gemv(x, layer.weight, layer.bias))
    assert layer.packed is not None  # a CPU with the kernel has oneDNN's too
    x = torch.randn(most + 1, 128).to(dtype)
    assert torch.equal(layer(x), PackedLinear(layer.weight, layer.bias).forward(x))


def test_an_input_of_another_dtype_leaves_the_kernel_alone() -> None:
    _kernel_for(torch.float32)
    layer = _prepacked(torch.float32, bias=False)
    x = torch.randn(1, 128, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # torch's own matmul refuses the mix; no kernel error
        layer(x)


def test_a_layer_before_prepack_has_no_kernel() -> None:
    layer = Linear(128, 72)
    assert layer.few_rows is None
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_the_kernel_follows_the_weights_when_they_move() -> None:
    _kernel_for(torch.float32)
    layer = _prepacked(torch.float32)
    x = torch.randn(1, 128)
    before = layer(x)
    gather_weights(layer)
    assert layer.few_rows is not None
    assert layer.few_rows[1].data_ptr() == layer.weight.data_ptr()
    assert layer.few_rows[2] is not None and layer.few_rows[2].data_ptr() == layer.bias.data_ptr()
    assert torch.equal(layer(x), before)


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_tied"))  # tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tied_vocab_projection_of_few_rows_takes_the_kernel(
    tied_folder: Path, dtype: torch.dtype
) -> None:
    ops = _kernel_for(dtype)
    model, _ = load_model(tied_folder, select_backend("auto"), dtype=dtype)
    assert model.lm_head is None
    model.prepack()
    assert model.few_row_logits is not None
    weight = model.embed_tokens.weight
    hidden = torch.randn(3, weight.shape[1]).to(dtype)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, ops.dense_gemv(hidden, weight, None).float())
    many = torch.randn(GEMV_MAX_ROWS[dtype] + 1, weight.shape[1]).to(dtype)
    torch.testing.assert_close(
        model.compute_logits(many), (many.double() @ weight.double().T).float(),
        rtol=2**-7, atol=1e-2,
    )  # fmt: skip
