"""Q4_1 weights kept 4-bit: the block decoding against gguf's own, the int4 linear against the
dequantized weights, and a whole model loaded from a GGUF against its dequantized twin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import save_file

from kvrelay.models import load_model
from kvrelay.models.gguf_blocks import (
    QuantizedWeightError,
    dequantize_q4_1,
    q4_1_fields,
)
from kvrelay.models.gguf_convert import open_gguf, read_gguf_weights
from kvrelay.models.quantized import (
    DENSE_FROM_ROWS,
    QUANT_KERNEL_ENV,
    Int4Linear,
    int4_kernel_fits,
)
from kvrelay.models.quantized_loading import QuantizationError, find_gguf, read_quantized_weights
from kvrelay_kernels import select_backend

Q4_1 = GGMLQuantizationType.Q4_1
Q8_0 = GGMLQuantizationType.Q8_0
F32 = GGMLQuantizationType.F32


def _q4_1(weight: np.ndarray) -> torch.Tensor:
    """gguf's own Q4_1 quantization of `[out, in]` fp32 weights, as `[out, bytes]` uint8."""
    return torch.from_numpy(np.array(quants.quantize(weight, Q4_1)))


def _random_weight(out: int, inp: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((out, inp)) * 0.05 + rng.standard_normal((out, 1)) * 0.01).astype(
        np.float32
    )


def test_dequantize_equals_gguf_bit_for_bit() -> None:
    raw = _q4_1(_random_weight(48, 96, 0))
    expected = quants.dequantize(raw.numpy(), Q4_1)
    assert torch.equal(dequantize_q4_1(raw, 96), torch.from_numpy(np.array(expected)))


def test_fields_split_nibbles_in_gguf_element_order() -> None:
    # One block: d = 1, m = -8, codes 0..15 in low nibbles (elements 0-15), 15..0 in high.
    codes = bytes(lo | ((15 - lo) << 4) for lo in range(16))
    block = np.float16(1.0).tobytes() + np.float16(-8.0).tobytes() + codes
    raw = torch.frombuffer(bytearray(block), dtype=torch.uint8).reshape(1, 20)
    q, d, m = q4_1_fields(raw, 32)
    assert q.tolist() == [list(range(16)) + list(range(15, -1, -1))]
    assert d.item() == 1.0 and m.item() == -8.0
    assert dequantize_q4_1(raw, 32)[0, :3].tolist() == [-8.0, -7.0, -6.0]


@pytest.mark.parametrize(("shape", "in_features"), [((4, 40), 96), ((4, 41), 64), ((4, 40), 60)])
def test_malformed_rows_are_refused(shape: tuple[int, int], in_features: int) -> None:
    with pytest.raises(QuantizedWeightError, match=r"does not match config\.json"):
        q4_1_fields(torch.zeros(shape, dtype=torch.uint8), in_features)


def test_kernel_shape_limits() -> None:
    assert int4_kernel_fits(960, 576) and int4_kernel_fits(16, 32)
    assert not int4_kernel_fits(40, 64)  # rows not a multiple of 16
    with pytest.raises(QuantizedWeightError, match="without --quantization"):
        Int4Linear(_q4_1(_random_weight(40, 64, 1)), 64, None, torch.float32)


@pytest.mark.parametrize("rows", [1, 4, 16, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_fp32_equals_the_dequantized_matmul(
    quant_kernel: str, rows: int, with_bias: bool
) -> None:
    raw = _q4_1(_random_weight(96, 128, rows))
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(96, generator=gen) if with_bias else None
    layer = Int4Linear(raw, 128, bias, torch.float32)
    x = torch.randn(rows, 128, generator=gen)
    expected = F.linear(x, dequantize_q4_1(raw, 128), bias)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    # Same weights; only the summation order (and m + 8d, exact here) differ.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_int4_linear_bf16_is_within_bf16_rounding(quant_kernel: str) -> None:
    raw = _q4_1(_random_weight(64, 256, 7))
    layer = Int4Linear(raw, 256, None, torch.bfloat16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), dequantize_q4_1(raw, 256))
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    # A broken layout (e.g. nibbles swapped) is far off, so the check above can fail.
    assert (out.float() - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_run_the_dequantized_weight_densely(dtype: torch.dtype) -> None:
    raw = _q4_1(_random_weight(64, 128, 3))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    layer = Int4Linear(raw, 128, bias, dtype)
    if layer.ops is None:
        pytest.skip("the CPU block kernel did not build here")
    few = "kvrelay blocks" if Int4Linear.few_rows_on_blocks(dtype) else "torch int4"
    assert f"few rows={few}, from 32 rows=kvrelay dequantized, dense" in repr(layer)
    assert torch.equal(layer.dequantized(), dequantize_q4_1(raw, 128).to(dtype))
    x = torch.randn(DENSE_FROM_ROWS, 128, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.inference_mode():
        out = layer(x)
        assert torch.equal(out, F.linear(x, layer.dequantized(), layer.bias))
        # One row fewer takes the few-row kernel: the same values up to its rounding.
        fewer = layer(x[:-1])
    torch.testing.assert_close(fewer.float(), out[:-1].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("dtype", "native_bf16", "on_blocks"),
    [
        (torch.float32, True, True),  # torch's int4 kernel is ~20x slower in fp32
        (torch.float32, False, True),
        (torch.bfloat16, True, False),  # its bf16 path wins where bf16 is native
        (torch.bfloat16, False, True),  # and loses to the block loop on AVX2
    ],
)
def test_q4_1_few_rows_take_torch_int4_only_in_native_bf16(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, native_bf16: bool, on_blocks: bool
) -> None:
    monkeypatch.setattr("kvrelay.models.quantized.cpu_has_native_bf16", lambda: native_bf16)
    assert Int4Linear.few_rows_on_blocks(dtype) is on_blocks
    layer = Int4Linear(_q4_1(_random_weight(32, 64, 2)), 64, None, dtype)
    if layer.ops is None:
        pytest.skip("the CPU block kernel did not build here")
    assert layer.blocks_for_few_rows is on_blocks
    assert hasattr(layer, "int4") is not on_blocks  # no second copy of the codes when unused
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        out = layer(x)
    expected = F.linear(x.float(), dequantize_q4_1(_q4_1(_random_weight(32, 64, 2)), 64))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_a_large_weight_is_dequantized_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvrelay.models.quantized.DENSE_SLICE_ROWS", 48)  # 3 slices, 1 short
    raw = _q4_1(_random_weight(112, 64, 8))
    bias = torch.randn(112, generator=torch.Generator().manual_seed(8))
    layer = Int4Linear(raw, 64, bias, torch.float32)
    if layer.ops is None:
        pytest.skip("the CPU block kernel did not build here")
    x = torch.randn(DENSE_FROM_ROWS, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        out = layer(x)
    assert torch.equal(layer.dequantized(slice(48, 96)), dequantize_q4_1(raw, 64)[48:96])
    expected = F.linear(x, dequantize_q4_1(raw, 64), bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _q4_1(_random_weight(16, 32, 1))
    monkeypatch.setenv(QUANT_KERNEL_ENV, "torch")
    torch_only = repr(Int4Linear(raw, 32, None, torch.bfloat16))
    assert "few rows=torch int4, from 32 rows=torch int4" in torch_only
    monkeypatch.setenv(QUANT_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="KVRELAY_CPU_QUANT_KERNEL='fast'"):
        Int4Linear(raw, 32, None, torch.bfloat16)


# A tiny Llama whose every matmul fits the int4 kernel: hidden 64, 4 heads of 16, 2 kv heads.
_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
_LAYER_SHAPES = {
    "attn_q": (64, 64),
    "attn_k": (32, 64),
    "attn_v": (32, 64),
    "attn_output": (64, 64),
    "ffn_gate": (96, 64),
    "ffn_up": (96, 64),
    "ffn_down": (64, 96),
}


def _write_tiny_gguf(
    path: Path, types: dict[str, GGMLQuantizationType] | None = None, default: Any = Q4_1
) -> None:
    """The tiny model's GGUF, each matmul of type `types.get(name, default)` (F32 written
    as floats), the token embedding Q8_0 when `default` is (as in the default model's)."""
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    _add(writer, "token_embd.weight", (rng.standard_normal((128, 64)) * 0.5).astype("f4"),
         Q8_0 if default == Q8_0 else F32)  # fmt: skip
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    for i in range(_CONFIG["num_hidden_layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(64, np.float32))
        for j, (name, (out, inp)) in enumerate(_LAYER_SHAPES.items()):
            weight = _random_weight(out, inp, seed=10 * i + j)
            _add(writer, f"blk.{i}.{name}.weight", weight, (types or {}).get(name, default))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: GGUFWriter, name: str, weight: np.ndarray, qtype: Any) -> None:
    if qtype == F32:
        writer.add_tensor(name, weight)
    else:
        writer.add_tensor(name, quants.quantize(weight, qtype), raw_dtype=qtype)


def make_gguf_folder(
    folder: Path, types: dict[str, GGMLQuantizationType] | None = None, default: Any = Q4_1
) -> Path:
    """`folder` with config.json, the GGUF (source.gguf) and its dequantized safetensors."""
    (folder / "config.json").write_text(json.dumps(_CONFIG))
    _write_tiny_gguf(folder / "source.gguf", types, default)
    dense = read_gguf_weights(open_gguf(folder / "source.gguf"), 4, 2, keep_quantized=frozenset())
    save_file({k: v.contiguous() for k, v in dense.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def tiny_gguf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Q4_1 matmul weights."""
    return make_gguf_folder(tmp_path_factory.mktemp("tiny_q4_1"))


def _forward_logits(model: Any, paged_kv: Any, ids: list[int]) -> torch.Tensor:
    kv = paged_kv(model, num_blocks=8, block_size=4)
    return kv.forward_logits(model, [("s", ids)])  # type: ignore[no-any-return]


def test_q4_1_model_equals_its_dequantized_twin(tiny_gguf_folder: Path, paged_kv: Any) -> None:
    backend = select_backend("auto")
    dense, _ = load_model(tiny_gguf_folder, backend)
    quant, _ = load_model(tiny_gguf_folder, backend, quantization="q4_1")
    int4 = [m for m in quant.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 2 * 4  # qkv, o, gate_up, down per layer: fused rows stayed 4-bit
    assert not any(p.dtype == torch.uint8 for p in quant.parameters())
    ids = [5, 17, 99, 3, 64, 12, 7]
    expected = _forward_logits(dense, paged_kv, ids)
    got = _forward_logits(quant, paged_kv, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_auto_uses_the_gguf_and_none_the_safetensors(tiny_gguf_folder: Path) -> None:
    backend = select_backend("auto")
    auto, _ = load_model(tiny_gguf_folder, backend, quantization="auto")
    plain, _ = load_model(tiny_gguf_folder, backend, quantization="none")
    assert any(isinstance(m, Int4Linear) for m in auto.modules())
    assert not any(isinstance(m, Int4Linear) for m in plain.modules())


def test_quantization_errors_say_what_to_do(tiny_gguf_folder: Path, tmp_path: Path) -> None:
    from kvrelay.config import ModelConfig

    config = ModelConfig.from_pretrained(tiny_gguf_folder)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(QuantizationError, match="choose one of none, auto, q4_1"):
        read_quantized_weights(tiny_gguf_folder, "q5_k", config, cpu)
    with pytest.raises(QuantizationError, match="CPU only"):
        read_quantized_weights(tiny_gguf_folder, "q4_1", config, cuda)
    assert read_quantized_weights(tiny_gguf_folder, "auto", config, cuda) is None
    (tmp_path / "config.json").write_text(json.dumps(_CONFIG))
    with pytest.raises(QuantizationError, match="has none"):
        read_quantized_weights(tmp_path, "q4_1", config, cpu)
    assert read_quantized_weights(tmp_path, "auto", config, cpu) is None


def test_several_gguf_files_need_a_source_gguf(tmp_path: Path) -> None:
    assert find_gguf(tmp_path) is None
    (tmp_path / "a.gguf").touch()
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").touch()
    with pytest.raises(QuantizationError, match=r"source\.gguf"):
        find_gguf(tmp_path)
    (tmp_path / "source.gguf").touch()
    assert find_gguf(tmp_path) == tmp_path / "source.gguf"


def test_a_quantized_load_parses_the_gguf_once(
    tiny_gguf_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF's header parse walks its whole vocabulary (5.8 s for the default model): the
    load's three questions (the matmul types, the weights, the embedding's raw blocks for the
    vocab projection) share one parse."""
    import gguf

    parsed: list[Path] = []
    real = gguf.GGUFReader

    def counting(path: Path, *args: Any, **kwargs: Any) -> Any:
        parsed.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    model, _ = load_model(tiny_gguf_folder, select_backend("auto"), quantization="q4_1")
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    assert parsed == [tiny_gguf_folder / "source.gguf"]
