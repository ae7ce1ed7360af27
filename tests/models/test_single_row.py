"""The single-row fp32 path is measured per weight shape at prepack (models/single_row.py), or
pinned by KVRELAY_CPU_SINGLE_ROW; either path gives the same numbers up to summation order."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.layers import Linear, PackedLinear, can_prepack
from kvrelay.models.single_row import (
    SINGLE_ROW_ENV,
    choose_single_row_paths,
    single_row_choice,
)

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.empty(1)), reason="oneDNN cannot pack weights here"
)


def packed_layers(shapes: list[tuple[int, int]]) -> list[Linear]:
    """Layers on oneDNN's packed copies, as `Linear.prepack` makes them where kvrelay's
    blocked kernel does not build."""
    layers = []
    for out_features, in_features in shapes:
        layer = Linear(in_features, out_features, bias=False)
        layer.packed = PackedLinear(layer.weight, None)
        layers.append(layer)
    return layers


def triples(layers: list[Linear]) -> list[tuple[torch.Tensor, torch.Tensor | None, PackedLinear]]:
    return [(layer.weight, layer.bias, layer.packed) for layer in layers if layer.packed]


def test_pinned_choices_set_every_fp32_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = packed_layers([(64, 32), (64, 32), (32, 64)])
    monkeypatch.setenv(SINGLE_ROW_ENV, "packed")
    assert choose_single_row_paths(triples(layers)) == {(64, 32): True, (32, 64): True}
    assert all(layer.packed is not None and layer.packed.single_row for layer in layers)
    monkeypatch.setenv(SINGLE_ROW_ENV, "dense")
    assert choose_single_row_paths(triples(layers)) == {(64, 32): False, (32, 64): False}
    assert not any(layer.packed is not None and layer.packed.single_row for layer in layers)


def test_measured_choice_is_one_per_shape_and_both_paths_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SINGLE_ROW_ENV, raising=False)
    assert single_row_choice() == "auto"
    layers = packed_layers([(256, 128), (256, 128), (128, 256)])
    chosen = choose_single_row_paths(triples(layers))
    assert set(chosen) == {(256, 128), (128, 256)}
    same_shape = [layer.packed.single_row for layer in layers[:2] if layer.packed]
    assert same_shape == [chosen[(256, 128)]] * 2
    x = torch.randn(1, 128)
    with torch.inference_mode():
        packed_out = layers[0].packed.forward(x) if layers[0].packed else None
        layers[0].packed = None  # the dense path
        dense_out = layers[0].forward(x)
    assert packed_out is not None
    torch.testing.assert_close(packed_out, dense_out, rtol=1e-5, atol=1e-5)


def test_bf16_layers_are_left_on_the_packed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SINGLE_ROW_ENV, "dense")
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    if not can_prepack(weight):
        pytest.skip("this CPU has no native bf16")
    packed = PackedLinear(weight, None)
    assert choose_single_row_paths([(weight, None, packed)]) == {}
    assert packed.single_row


def test_a_bad_setting_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SINGLE_ROW_ENV, "fast")
    with pytest.raises(ValueError, match="KVRELAY_CPU_SINGLE_ROW='fast': use one of auto"):
        single_row_choice()
