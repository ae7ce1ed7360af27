"""Q8_0 weights kept 8-bit as two int4 planes: the block decoding against gguf's own, the
plane split exact for every code, the layer against the dequantized weights, the loader's
choices (q8_0, auto, mixed formats) and a whole model against its dequantized twin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from test_quantized import F32, Q4_1, Q8_0, _forward_logits, _random_weight, make_gguf_folder

from kvrelay.config import ModelConfig
from kvrelay.models import load_model
from kvrelay.models.gguf_blocks import (
    QuantizedWeightError,
    dequantize,
    dequantize_q8_0,
    q8_0_fields,
    raw_format,
)
from kvrelay.models.gguf_convert import open_gguf
from kvrelay.models.layers import Linear
from kvrelay.models.quantized import (
    Int4Linear,
    Int4PlanesLinear,
    Q8_0Linear,
)
from kvrelay.models.quantized_loading import (
    QuantizationError,
    matmul_types,
    read_quantized_weights,
)
from kvrelay_kernels import select_backend


def _q8_0(weight: np.ndarray) -> torch.Tensor:
    """gguf's own Q8_0 quantization of `[out, in]` fp32 weights, as `[out, bytes]` uint8."""
    return torch.from_numpy(np.array(quants.quantize(weight, Q8_0)))


def _block(d: float, codes: list[int]) -> bytes:
    return np.float16(d).tobytes() + np.array(codes, np.int8).tobytes()


def test_dequantize_equals_gguf_bit_for_bit() -> None:
    raw = _q8_0(_random_weight(48, 96, 0))
    assert raw.shape == (48, 3 * 34)
    expected = torch.from_numpy(np.array(quants.dequantize(raw.numpy(), Q8_0)))
    assert torch.equal(dequantize_q8_0(raw, 96), expected)
    assert raw_format(raw, 96) == "Q8_0" and torch.equal(dequantize(raw, 96), expected)


def test_fields_read_signed_codes_in_element_order() -> None:
    codes = [-128, 127, -1, 0, 1, *range(27)]
    raw = torch.frombuffer(bytearray(_block(0.5, codes)), dtype=torch.uint8).reshape(1, 34)
    q, d = q8_0_fields(raw, 32)
    assert q.tolist() == [codes] and d.tolist() == [[0.5]]
    assert dequantize_q8_0(raw, 32)[0, :5].tolist() == [-64.0, 63.5, -0.5, 0.0, 0.5]


def _every_code_rows(rows: int, scales: torch.Tensor) -> torch.Tensor:
    """`[rows, 256 / 32 * 34]` Q8_0: every row holds the codes -128..127 in order, block b of
    row r scaled by `scales[r, b]`."""
    codes = torch.arange(-128, 128, dtype=torch.int8).view(torch.uint8).reshape(8, 32)
    d = scales.half().view(torch.uint8).reshape(rows, 8, 2)
    return torch.cat((d, codes.expand(rows, 8, 32)), -1).reshape(rows, 8 * 34)


def test_the_two_plane_split_is_exact_for_every_code(quant_kernel: str) -> None:
    # x = I reads the layer's effective weights back one column per row: with fp32 compute
    # and fp16 scales every (h - 8) 16d + (l - 8) d + 8d is exact, so they equal d * q bit
    # for bit for all 256 codes, including -128 and 127 (the nibbles' ends).
    gen = torch.Generator().manual_seed(3)
    scales = torch.cat((torch.rand(16, 7, generator=gen) * 0.1, torch.tensor([[65504.0]] * 16)), 1)
    raw = _every_code_rows(16, scales)
    layer = Q8_0Linear(raw, 256, None, torch.float32)
    with torch.inference_mode():
        effective = layer(torch.eye(256)).t()
    assert torch.equal(effective, dequantize_q8_0(raw, 256))
    with torch.inference_mode():  # a few rows: the block kernel's own loop where it runs
        assert torch.equal(layer(torch.eye(256)[:8]).t(), effective[:, :8])
    assert effective[0, 0] == -128 * scales[0, 0].half().float()


@pytest.mark.parametrize("rows", [1, 4, 16, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q8_0_linear_fp32_equals_the_dequantized_matmul(
    quant_kernel: str, rows: int, with_bias: bool
) -> None:
    raw = _q8_0(_random_weight(96, 128, rows))
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(96, generator=gen) if with_bias else None
    layer = Q8_0Linear(raw, 128, bias, torch.float32)
    if quant_kernel == "torch":
        assert layer.int4.planes == 2  # two int4 planes: 8 bits per weight
        assert layer.int4.scales_and_zeros.shape == (2 * 128 // 32, 96, 2)
    else:
        assert layer.codes.dtype == torch.int8 and layer.codes.shape == (96, 128)
    x = torch.randn(rows, 128, generator=gen)
    expected = F.linear(x, dequantize_q8_0(raw, 128), bias)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    # Same weights; only the summation order (two partial sums) differs.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_q8_0_linear_bf16_is_within_bf16_rounding(quant_kernel: str) -> None:
    raw = _q8_0(_random_weight(64, 256, 7))
    layer = Q8_0Linear(raw, 256, None, torch.bfloat16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), dequantize_q8_0(raw, 256))
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    # A broken split (e.g. the planes' scales swapped) is far off, so the check can fail.
    assert (out.float() - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q8_0_linear_bf16_rounds_once_like_a_dense_matmul(quant_kernel: str, seed: int) -> None:
    # One int4 call over both planes rounds the output to bf16 once; two calls summed in
    # bf16 rounded three times: on these seeds 0.95-0.96x a bf16 dense matmul's mean error,
    # against 1.12-1.18x for two calls (and about 1.5x on the model's shapes).
    raw = _q8_0(_random_weight(64, 256, seed))
    weight = dequantize_q8_0(raw, 256)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(seed)).bfloat16()
    expected = F.linear(x.float(), weight)
    with torch.inference_mode():
        err = (Q8_0Linear(raw, 256, None, torch.bfloat16)(x).float() - expected).abs().mean()
    dense_err = (F.linear(x, weight.bfloat16()).float() - expected).abs().mean()
    assert err < 1.07 * dense_err


@pytest.mark.parametrize(
    ("raw", "in_features"),
    [
        (torch.zeros(4, 68, dtype=torch.uint8), 96),  # 2 blocks for 3
        (torch.zeros(4, 69, dtype=torch.uint8), 64),  # a partial block
        (torch.zeros(4, 68, dtype=torch.uint8), 60),  # not whole blocks of weights
        (torch.zeros(4, 68, dtype=torch.int16), 64),  # not bytes
        (torch.zeros(272, dtype=torch.uint8), 64),  # not rows
    ],
)
def test_malformed_rows_are_refused(raw: torch.Tensor, in_features: int) -> None:
    with pytest.raises(QuantizedWeightError, match=r"Q8_0 data .* does not match config\.json"):
        q8_0_fields(raw, in_features)


def test_a_non_finite_scale_is_refused() -> None:
    blocks = _block(0.5, [1] * 32) + _block(float("nan"), [1] * 32)
    raw = torch.frombuffer(bytearray(blocks * 2), dtype=torch.uint8).reshape(2, 68)
    with pytest.raises(QuantizedWeightError, match=r"block 1 of row 0 .*non-finite.*2 such"):
        q8_0_fields(raw, 64)


def test_a_width_of_neither_format_is_refused() -> None:
    assert raw_format(torch.zeros(2, 40, dtype=torch.uint8), 64) == "Q4_1"
    with pytest.raises(QuantizedWeightError, match=r"neither Q4_1 .* nor Q8_0"):
        raw_format(torch.zeros(2, 50, dtype=torch.uint8), 64)
    with pytest.raises(QuantizedWeightError, match="neither"):
        dequantize(torch.zeros(2, 68, dtype=torch.uint8), 48)


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    with pytest.raises(QuantizedWeightError, match=r"\[40, 64\].*without --quantization"):
        Q8_0Linear(_q8_0(_random_weight(40, 64, 1)), 64, None, torch.bfloat16)


@pytest.fixture(scope="module")
def q8_0_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Q8_0 matmul weights and a Q8_0 token embedding."""
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_q8_0"), default=Q8_0)


def _layers(model: Any, kind: type) -> list[Any]:
    """The decoder layers' linears of `kind` (the vocab projection's blocks, when the loader
    gives it some, are `model.quantized_logits`: tests/models/test_quantized_logits.py)."""
    return [m for m in model.layers.modules() if isinstance(m, kind)]


def test_q8_0_model_equals_its_dequantized_twin(q8_0_folder: Path, paged_kv: Any) -> None:
    backend = select_backend("auto")
    dense, _ = load_model(q8_0_folder, backend)
    quant, _ = load_model(q8_0_folder, backend, quantization="q8_0")
    assert len(_layers(quant, Q8_0Linear)) == 2 * 4  # qkv, o, gate_up, down: fused rows 8-bit
    assert not any(p.dtype == torch.uint8 for p in quant.parameters())
    # The Q8_0 token embedding is no linear: dequantized exactly, as gguf does.
    assert torch.equal(quant.embed_tokens.weight, dense.embed_tokens.weight)
    for ids in ([5, 17, 99, 3, 64, 12, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]):
        expected = _forward_logits(dense, paged_kv, ids)
        got = _forward_logits(quant, paged_kv, ids)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_q8_0_greedy_tokens_equal_the_dequantized_model(q8_0_folder: Path) -> None:
    from kvrelay import SamplingParams
    from kvrelay.engine.args import EngineArgs

    def greedy(quantization: str) -> list[int]:
        args = EngineArgs(
            model=str(q8_0_folder), quantization=quantization, dtype="float32", num_blocks=16
        )
        engine = args.create_engine()
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        engine.add_request("r", [5, 17, 99, 3], params)
        out: list[int] = []
        while engine.has_unfinished_requests():
            for result in engine.step():
                out = list(result.outputs[0].token_ids)
        return out

    tokens = greedy("q8_0")
    assert len(tokens) == 12 and tokens == greedy("none")


def test_auto_picks_q8_0_and_q4_1_by_the_gguf(q8_0_folder: Path, tmp_path: Path) -> None:
    backend = select_backend("auto")
    auto, _ = load_model(q8_0_folder, backend, quantization="auto")
    assert len(_layers(auto, Q8_0Linear)) == 8 and not _layers(auto, Int4Linear)
    assert matmul_types(open_gguf(q8_0_folder / "source.gguf")) == {"Q8_0": 14}
    q4_1 = make_gguf_folder(tmp_path)
    auto, _ = load_model(q4_1, backend, quantization="auto")
    assert len(_layers(auto, Int4Linear)) == 8 and not _layers(auto, Q8_0Linear)


def test_mixed_formats_keep_what_fuses(tmp_path: Path, paged_kv: Any) -> None:
    # q Q8_0 beside k Q4_1 and v F32 cannot share one fused row layout: that group is
    # dequantized; gate/up (both Q8_0), o (Q4_1) and down (Q8_0) stay low-bit.
    types = {"attn_q": Q8_0, "attn_k": Q4_1, "attn_v": F32, "attn_output": Q4_1}
    folder = make_gguf_folder(tmp_path, types, default=Q8_0)
    backend = select_backend("auto")
    dense, _ = load_model(folder, backend)
    quant, _ = load_model(folder, backend, quantization="auto")
    layer = quant.layers[0]
    assert type(layer.self_attn.qkv_proj) is Linear
    assert isinstance(layer.self_attn.o_proj, Int4Linear)
    assert isinstance(layer.mlp.gate_up_proj, Q8_0Linear)
    assert isinstance(layer.mlp.down_proj, Q8_0Linear)
    ids = [5, 17, 99, 3, 64, 12, 7]
    got, expected = _forward_logits(quant, paged_kv, ids), _forward_logits(dense, paged_kv, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # q4_1 alone keeps only the Q4_1 o_proj (k's group is mixed): the rest loads dense.
    only, _ = load_model(folder, backend, quantization="q4_1")
    assert len(_layers(only, Int4PlanesLinear)) == 2


def test_errors_say_what_to_do(q8_0_folder: Path, tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(q8_0_folder)
    cpu = torch.device("cpu")
    with pytest.raises(QuantizationError, match="choose one of none, auto, q4_1, q8_0"):
        read_quantized_weights(q8_0_folder, "q5_k", config, cpu)
    with pytest.raises(QuantizationError, match="CPU only"):
        read_quantized_weights(q8_0_folder, "q8_0", config, torch.device("cuda"))
    (tmp_path / "q4_1").mkdir()
    q4_1 = make_gguf_folder(tmp_path / "q4_1")
    with pytest.raises(
        QuantizationError,
        match=r"no Q8_0 matmul weight in source\.gguf \(its matmul weights: 14 Q4_1\); "
        r"serve it with --quantization q4_1",
    ):
        read_quantized_weights(q4_1, "q8_0", config, cpu)
    with pytest.raises(QuantizationError, match=r"no Q4_1 matmul weight .* --quantization q8_0"):
        read_quantized_weights(q8_0_folder, "q4_1", config, cpu)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(QuantizationError, match=r"reads Q8_0 matmul weights .* has none"):
        read_quantized_weights(bare, "q8_0", config, cpu)
    assert read_quantized_weights(bare, "auto", config, cpu) is None


def test_a_gguf_of_other_types_is_refused_for_q8_0(tmp_path: Path) -> None:
    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"), F32)
    folder = make_gguf_folder(tmp_path, {**types, "ffn_gate": F32, "ffn_up": F32, "ffn_down": F32},
                              default=GGMLQuantizationType.F32)  # fmt: skip
    config = ModelConfig.from_pretrained(folder)
    with pytest.raises(QuantizationError, match=r"its matmul weights: 14 F32\); the default"):
        read_quantized_weights(folder, "q8_0", config, torch.device("cpu"))
    assert read_quantized_weights(folder, "auto", config, torch.device("cpu")) is None
