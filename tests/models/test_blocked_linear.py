"""Linear and the tied vocab projection on kvrelay's blocked kernel (kvrelay_kernels.
cpu_blocked): every row count takes it, other inputs fall back, and a model's packed weights
share one allocation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models.test_quantized import make_gguf_folder

from kvrelay.models import load_model
from kvrelay.models.layers import Linear
from kvrelay_kernels import select_backend
from kvrelay_kernels.cpu_blocked import blocked_ops_for, pack_blocks
from kvrelay_kernels.host_memory import in_one_allocation


def _kernel_for(dtype: torch.dtype) -> Any:
    module = blocked_ops_for(torch.empty(4, 64, dtype=dtype))
    if module is None:
        pytest.skip(f"no blocked kernel for {dtype} in this build (no AVX-512 / AVX512-BF16)")
    return module


def _prepacked(dtype: torch.dtype, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(128, 72, bias=bias).to(dtype)
    layer.requires_grad_(False)
    layer.prepack()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_takes_the_kernel_and_no_onednn_copy_is_made(dtype: torch.dtype) -> None:
    ops = _kernel_for(dtype)
    layer = _prepacked(dtype)
    assert layer.blocked is not None and layer.packed is None
    blocks, bias = pack_blocks(layer.weight), layer.bias.float()
    for rows in (1, 4, 16, 100):
        x = torch.randn(rows, 128).to(dtype)
        assert torch.equal(layer(x), ops.blocked_matmul(x, blocks, 72, bias))
        expected = torch.nn.functional.linear(x.double(), layer.weight.double(), bias.double())
        rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(layer(x).double(), expected, rtol=rtol, atol=1e-4)


def test_a_layer_packs_from_given_blocks() -> None:
    _kernel_for(torch.float32)
    layer = Linear(64, 40)
    blocks = pack_blocks(layer.weight)
    layer.prepack(blocks)
    assert layer.blocked is not None and layer.blocked[1] is blocks


def test_an_input_of_another_dtype_leaves_the_kernel_alone() -> None:
    _kernel_for(torch.float32)
    layer = _prepacked(torch.float32, bias=False)
    x = torch.randn(1, 128, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # torch's own matmul refuses the mix; no kernel error
        layer(x)


def test_a_3d_input_takes_torch() -> None:
    _kernel_for(torch.float32)
    layer = _prepacked(torch.float32)
    x = torch.randn(2, 3, 128)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_layer_before_prepack_has_no_kernel() -> None:
    layer = Linear(128, 72)
    assert layer.blocked is None
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_tied"))  # tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tied_vocab_projection_takes_the_kernel(tied_folder: Path, dtype: torch.dtype) -> None:
    ops = _kernel_for(dtype)
    model, _ = load_model(tied_folder, select_backend("auto"), dtype=dtype)
    assert model.lm_head is None
    model.prepack()
    assert model.blocked_logits is not None and model.packed_logits is None
    weight = model.embed_tokens.weight
    for rows in (3, 40):
        hidden = torch.randn(rows, weight.shape[1]).to(dtype)
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        direct = ops.blocked_matmul(hidden, pack_blocks(weight), weight.shape[0], None)
        assert torch.equal(logits, direct.float())
        torch.testing.assert_close(
            logits, (hidden.double() @ weight.double().T).float(), rtol=2**-7, atol=1e-2
        )


def test_a_models_packed_weights_lie_in_one_allocation_in_step_order(tied_folder: Path) -> None:
    _kernel_for(torch.float32)
    model, _ = load_model(tied_folder, select_backend("auto"), dtype=torch.float32)
    model.prepack()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    blocks = [m.blocked[1] for m in linears if m.blocked is not None]
    assert len(blocks) == len(linears) > 0
    assert model.blocked_logits is not None
    blocks.append(model.blocked_logits[1])
    assert in_one_allocation(blocks)
    addresses = [b.data_ptr() for b in blocks]
    assert addresses == sorted(addresses)
