"""The C++ decoder stack (models/decoder_stack.py, csrc_cpu/decoder_stack.cpp): all-decode CPU
steps through it give the Python layers' hidden states and KV cache bit for bit, on every
checkpoint shape the HF comparison covers; other steps and other models keep the Python
layers; and the kernel entry points it is built from are checked by name."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.hf_checkpoints import BASE, CASES, make_checkpoint
from tests.models.test_quantized import Q4_1, Q8_0, make_gguf_folder

from kvrelay.models import CausalLM, load_model
from kvrelay.models.decoder_stack import DecoderStack, build_decoder_stack
from kvrelay.models.quantized import DENSE_FROM_ROWS, Int4PlanesLinear
from kvrelay_kernels import select_backend
from kvrelay_kernels.cpu_blocked import blocked_ops_for
from kvrelay_kernels.cpu_stack import load_stack_ops, new_decoder_stack

pytest.importorskip("transformers")

VOCAB = BASE["vocab_size"]


def _needs_kernels(dtype: torch.dtype) -> None:
    if blocked_ops_for(torch.empty(4, 64, dtype=dtype)) is None or load_stack_ops() is None:
        pytest.skip(f"no blocked kernel for {dtype} or no decoder stack in this build")


def _load(folder: Path, dtype: torch.dtype, backend: str = "cpu") -> CausalLM:
    model, _ = load_model(folder, select_backend(backend), dtype=dtype)
    model.prepack()
    return model


class CountingStack(DecoderStack):
    """The model's stack, counting the steps it ran."""

    def __init__(self, stack: DecoderStack) -> None:
        super().__init__(stack.native, stack.dtype, stack.max_rows)
        self.steps = 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.steps += 1
        return super().forward(*args)


def _same_with_and_without_the_stack(
    models: tuple[CausalLM, CausalLM], paged_kv: Any, dtype: torch.dtype, decodes: int
) -> None:
    """Run the same steps through `models` (the first with its stack, the second without)
    and check the stack ran every decode step, and only those, bit for bit."""
    model, python = models
    assert model.decoder_stack is not None
    stack = CountingStack(model.decoder_stack)
    model.decoder_stack = stack
    python.decoder_stack = None
    steps = _steps(decodes)
    results = []
    for m in (model, python):
        kv = paged_kv(m, num_blocks=32, block_size=4, seed=3)
        kv.cache = kv.cache.to(dtype)
        results.append((_run(m, kv, steps), kv.cache))
    (got, got_cache), (expected, expected_cache) = results
    assert stack.steps == decodes  # the decode steps only: not the prefill, not the mixed step
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"step {i} differs"
    assert torch.equal(got_cache, expected_cache)


def _run(model: CausalLM, kv: Any, steps: list[list[tuple[str, list[int]]]]) -> list[torch.Tensor]:
    hidden = []
    for step in steps:
        input_ids, positions, attn = kv.step(step)
        with torch.inference_mode():
            hidden.append(model(input_ids, positions, kv.cache, attn))
    return hidden


def _steps(decodes: int) -> list[list[tuple[str, list[int]]]]:
    """Two prompts' prefill, a mixed step, then `decodes` all-decode steps."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (40, 3), generator=gen).tolist()
    steps = [[("a", [t[0] for t in tokens[:9]]), ("b", [t[1] for t in tokens[:5]])]]
    steps.append([("b", [tokens[5][1]]), ("c", [t[2] for t in tokens[:7]])])
    for i in range(decodes):
        steps.append([(seq, [tokens[10 + i][j]]) for j, seq in enumerate("abc")])
    return steps


# The cases with Llama's layer (Phi-3 and Mistral among them); Qwen3's q/k norms keep it off
# the stack (tests/models/test_families_vs_hf.py).
STACK_CASES = sorted(c for c, (family, _) in CASES.items() if family != "qwen3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", STACK_CASES)
def test_decode_steps_match_the_python_layers_bit_for_bit(
    tmp_path: Path, case: str, dtype: torch.dtype, paged_kv: Any
) -> None:
    _needs_kernels(dtype)
    family, overrides = CASES[case]
    make_checkpoint(tmp_path, family, overrides)
    models = (_load(tmp_path, dtype), _load(tmp_path, dtype))
    _same_with_and_without_the_stack(models, paged_kv, dtype, decodes=6)  # crosses blocks of 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("int8", [False, True], ids=["blocks", "int8"])
@pytest.mark.parametrize("source", ["q4_1", "q8_0"])
def test_gguf_block_matmuls_run_in_the_stack_bit_for_bit(
    tmp_path: Path, source: str, int8: bool, dtype: torch.dtype, paged_kv: Any
) -> None:
    _needs_kernels(dtype)
    folder = make_gguf_folder(tmp_path, default=Q4_1 if source == "q4_1" else Q8_0)

    def load() -> CausalLM:
        model, _ = load_model(folder, select_backend("cpu"), dtype=dtype, quantization=source,
                              int8_activations=int8)  # fmt: skip
        model.prepack()
        return model

    models = (load(), load())
    layers = [m for m in models[0].layers.modules() if isinstance(m, Int4PlanesLinear)]
    assert len(layers) == 8  # every matmul of both layers stays quantized
    stack = models[0].decoder_stack
    if any(layer.native_matmul() is None for layer in layers):
        # bf16 Q4_1 without int8 activations runs torch's int4 kernel: no C++ matmul to call.
        assert (source, int8, dtype) == ("q4_1", False, torch.bfloat16)
        assert stack is None
        return
    assert stack is not None
    # Without int8 activations the block loop serves few rows only (`forward` dequantizes
    # from DENSE_FROM_ROWS rows on): the stack leaves such steps to the Python layers.
    assert stack.max_rows == (sys.maxsize if int8 else DENSE_FROM_ROWS - 1)
    _same_with_and_without_the_stack(models, paged_kv, dtype, decodes=3)


def test_out_of_order_decodes_keep_the_python_layers(tmp_path: Path, paged_kv: Any) -> None:
    # A prefill chunk ahead of a decode: the plan gathers the decode's query (the stack
    # takes only decodes that are the step's rows in order).
    _needs_kernels(torch.float32)
    make_checkpoint(tmp_path, "llama", {"num_key_value_heads": 2})
    model = _load(tmp_path, torch.float32)
    assert model.decoder_stack is not None
    kv = paged_kv(model, num_blocks=16, block_size=4)
    _, _, first = kv.step([("a", [1, 2, 3])])
    h = torch.zeros(1, BASE["hidden_size"])
    assert not model.decoder_stack.takes(h, kv.cache, first)  # a prefill
    _, _, mixed = kv.step([("b", [4, 5]), ("a", [6])])
    assert not model.decoder_stack.takes(torch.zeros(3, BASE["hidden_size"]), kv.cache, mixed)
    _, _, decode = kv.step([("a", [7]), ("b", [8])])
    assert model.decoder_stack.takes(torch.zeros(2, BASE["hidden_size"]), kv.cache, decode)
    assert not model.decoder_stack.takes(
        torch.zeros(2, BASE["hidden_size"], dtype=torch.float64), kv.cache, decode
    )


def test_no_stack_without_the_cpu_backend_or_before_prepack(tmp_path: Path) -> None:
    _needs_kernels(torch.float32)
    make_checkpoint(tmp_path, "llama", {})
    assert _load(tmp_path, torch.float32, backend="torch").decoder_stack is None
    unpacked, _ = load_model(tmp_path, select_backend("cpu"), dtype=torch.float32)
    assert unpacked.decoder_stack is None and build_decoder_stack(unpacked) is None


def test_a_layer_off_the_blocked_kernel_keeps_the_python_layers(tmp_path: Path) -> None:
    _needs_kernels(torch.float32)
    make_checkpoint(tmp_path, "llama", {})
    model = _load(tmp_path, torch.float32)
    model.layers[1].mlp.down_proj.blocked = None  # as a quantized or oneDNN matmul would be
    assert build_decoder_stack(model) is None


def _entries() -> dict[str, Any]:
    from kvrelay_kernels import cpu_backend
    from kvrelay_kernels.cpu_blocked import load_blocked_ops
    from kvrelay_kernels.cpu_fused import load_fused_ops

    entries: dict[str, Any] = {}
    for module in (load_blocked_ops(), load_fused_ops(), cpu_backend.load_extension()):
        assert module is not None
        entries.update(module.entries)
    return entries


def test_the_stack_takes_only_the_kernels_it_names() -> None:
    _needs_kernels(torch.float32)
    entries = _entries()
    names = ("blocked_matmul", "rms_norm", "add_rms_norm", "rope", "silu_and_mul",
             "paged_decode_attention", "write_kv")  # fmt: skip
    assert set(entries) == {f"kvrelay.{name}" for name in names}
    stack_ops = load_stack_ops()
    assert stack_ops is not None
    assert stack_ops.DecoderStack(entries, 4, 2, 16, 1e-5, 0.25).num_layers == 0
    swapped = {**entries, "kvrelay.rope": entries["kvrelay.rms_norm"]}
    with pytest.raises(RuntimeError, match=r"expected the capsule kvrelay\.rope"):
        stack_ops.DecoderStack(swapped, 4, 2, 16, 1e-5, 0.25)
    missing = {k: v for k, v in entries.items() if k != "kvrelay.write_kv"}
    with pytest.raises(RuntimeError, match=r"no kernel kvrelay\.write_kv"):
        stack_ops.DecoderStack(missing, 4, 2, 16, 1e-5, 0.25)


def test_a_layer_needs_four_matmuls_each_on_a_kernel_it_was_given() -> None:
    _needs_kernels(torch.float32)
    from kvrelay_kernels.cpu_blocked import load_blocked_ops

    stack = new_decoder_stack(4, 2, 16, 1e-5, 0.25, [load_blocked_ops()])
    assert stack is not None
    norms = (torch.ones(64), torch.ones(64))
    blocked = ("kvrelay.blocked_matmul", [torch.zeros(32 * 64)], 32, None)
    with pytest.raises(RuntimeError, match="qkv, o, gate_up and down expected"):
        stack.add_layer(*norms, [blocked] * 3)
    with pytest.raises(RuntimeError, match=r"no kernel kvrelay\.q4_1_matmul given"):
        stack.add_layer(*norms, [blocked] * 3 + [("kvrelay.q4_1_matmul", [], 32, None)])
    with pytest.raises(RuntimeError, match=r"kvrelay\.rope is no matmul kernel"):
        stack.add_layer(*norms, [blocked] * 3 + [("kvrelay.rope", [], 32, None)])
    two = ("kvrelay.blocked_matmul", [torch.zeros(32 * 64)] * 2, 32, None)
    with pytest.raises(RuntimeError, match="takes 1 weight tensors, not 2"):
        stack.add_layer(*norms, [blocked] * 3 + [two])
    stack.add_layer(*norms, [blocked] * 4)
    assert stack.num_layers == 1
