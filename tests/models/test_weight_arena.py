"""models.weight_arena: a loaded CPU model's weights in one huge-page allocation, in module
order, with the same outputs, tied weights still tied, and kernels bound to the moved buffers."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models.test_quantized import (
    _LAYER_SHAPES,
    Q4_1,
    Q8_0,
    _forward_logits,
    make_gguf_folder,
)
from torch import nn

from kvrelay.models import load_model
from kvrelay.models.quantized import Int4PlanesLinear
from kvrelay.models.weight_arena import gather_weights
from kvrelay_kernels import select_backend
from kvrelay_kernels.cpu_quantized import load_int8_dot_ops
from kvrelay_kernels.host_memory import in_one_allocation


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_1 matmuls and a Q8_0 token embedding, as the default model's GGUF has."""
    layers = {name: Q4_1 for name in _LAYER_SHAPES}
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_arena"), layers, default=Q8_0)


def _load(folder: Path, monkeypatch: pytest.MonkeyPatch, gathered: bool, **kwargs: Any) -> Any:
    if not gathered:  # the model as loaded before weight_arena existed
        monkeypatch.setattr("kvrelay.models.loader.gather_weights", lambda model: 0)
    model, _ = load_model(folder, select_backend("auto"), **kwargs)
    monkeypatch.undo()
    return model


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


# Dense matmuls (MKL, oneDNN) may sum in another order when a weight starts on another
# boundary (as loaded, safetensors' tensors start on 8 bytes; gathered, on 64): a rounding
# apart. kvrelay's block kernels read the same bytes in the same order: bit for bit.
EXACT = (0.0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "tolerance"),
    [
        ({}, (1e-5, 1e-5)),
        ({"dtype": torch.bfloat16}, (1e-2, 1e-2)),
        ({"quantization": "q4_1"}, EXACT),
        ({"quantization": "q4_1", "int8_activations": True}, EXACT),
    ],
    ids=["fp32", "bf16", "q4_1", "q4_1-int8"],
)
def test_the_loader_gathers_the_weights_and_changes_no_output(
    folder: Path,
    paged_kv: Any,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    tolerance: tuple[float, float],
) -> None:
    if kwargs.get("int8_activations") and load_int8_dot_ops() is None:
        pytest.skip("the int8 kernel does not build here")
    model = _load(folder, monkeypatch, gathered=True, **kwargs)
    loose = _load(folder, monkeypatch, gathered=False, **kwargs)
    assert in_one_allocation(_tensors(model))
    assert not in_one_allocation(_tensors(loose))
    ids = [5, 17, 99, 3, 64, 12, 7]
    got, expected = _forward_logits(model, paged_kv, ids), _forward_logits(loose, paged_kv, ids)
    rtol, atol = tolerance
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_module_order_is_the_order_in_memory(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(folder, monkeypatch, gathered=True, quantization="q4_1")
    starts = []
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                starts.append(tensor.data_ptr())
    first_seen = list(dict.fromkeys(starts))  # a tied weight counts where it first appears
    assert first_seen == sorted(first_seen)


def test_quantized_kernels_are_bound_to_the_moved_buffers(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(folder, monkeypatch, gathered=True, quantization="q4_1")
    layers = [m for m in model.modules() if isinstance(m, Int4PlanesLinear)]
    bound = [layer for layer in layers if layer._few_rows is not None]
    assert bound, "the block kernel should build here"
    for layer in bound:
        _, weights = layer._few_rows
        assert weights[0] is layer.codes and weights[1] is layer.d
        assert in_one_allocation([layer.codes, next(model.parameters())])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(6.0))


def test_a_tied_weight_stays_one_parameter_and_the_originals_are_freed() -> None:
    module = _Tied()
    original = module.embed.weight
    values = original.detach().clone()
    alive = weakref.ref(original)
    del original
    moved = gather_weights(module)
    assert moved >= (16 * 8 + 6) * 4
    assert module.head.weight is module.embed.weight
    assert isinstance(module.embed.weight, nn.Parameter)
    assert torch.equal(module.embed.weight, values)
    assert torch.equal(module.table, torch.arange(6.0))
    assert in_one_allocation([module.embed.weight, module.table])
    gc.collect()
    assert alive() is None


def test_a_model_on_another_device_is_left_alone() -> None:
    with torch.device("meta"):
        module = _Tied()
    assert gather_weights(module) == 0
    assert module.embed.weight.is_meta
