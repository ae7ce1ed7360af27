#!/usr/bin/env python
"""One stream's decode speed with fp32, bf16, Q4_1 and Q8_0 weights, and how exact the quantized
ones are (issue 15).

Four parts, all in one run on the default model (SmolLM2-135M-Instruct, Q4_1 at the source;
its Q8_0 twin is written once under --q8-0-folder: every Q4_1 matmul weight requantized to
Q8_0 with gguf's own quantizer, beside the dequantized safetensors as the exact reference):
  --layers   the model's linear shapes at 1, 4, 16 and 64 rows: fp32 dense / packed, bf16
             dense / packed (oneDNN), Q4_1 and Q8_0 through torch's int4 kernel alone (Q8_0 as
             two int4 planes) and as the layers run them where kvrelay's block kernel builds
             (Q8_0 through its own loop; from 32 rows on both dequantize and run the dense
             matmul), and torch's int8
             kernel with one scale per row (requantized: NOT exact; its largest weight error
             relative to the row's largest weight is printed), and Q4_1 and Q8_0 with int8
             activations (llama.cpp's scheme, not exact), bf16 activations; median
             microseconds per matmul.
  decode     the offline engine decodes one greedy stream; median wall time of a decode step
             and its tokens/s, per configuration (dtype + quantization).
  --hf       kvrelay's greedy tokens against transformers' in bf16 and fp32.
  --exact    Q4_1 and Q8_0 weights (fp32, bf16 and int8 activations) against their
             dequantized fp32 models on a few prompts:
             greedy text,
             and over prompt + reference continuation (teacher-forced) the top-1 agreement and
             the largest logit difference.

llama.cpp's figure on the same GGUF is printed beside it when `llama-bench` is found on PATH
or under ~/.cache (none is installed by this script).

    .venv/bin/python benchmarks/quantized_decode.py --layers --exact --hf --threads 1
    .venv/bin/python benchmarks/quantized_decode.py --configs bfloat16:q4_1 bfloat16:q8_0
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvrelay.engine.engine import Engine
from kvrelay.models.llama import CausalLM

PROMPT = "The history of the printing press begins"
EXACT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "Photosynthesis is the process by which",
    "1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "In 1969, Neil Armstrong",
    "Translate to French: Good morning, how are you?",
)
CONFIGS = ("float32:none", "bfloat16:none", "float32:q4_1", "bfloat16:q4_1", "bfloat16:q4_1:int8",
           "bfloat16:q8_0")  # fmt: skip
# Where the default model's Q8_0 twin is written (once) for the q8_0 configurations.
Q8_0_FOLDER = Path("/tmp/kvrelay-smollm2-q8_0")
# Compared with the fp32 model whose weights are the GGUF's dequantized exactly.
EXACT_CANDIDATES = ("float32:q4_1", "bfloat16:q4_1", "bfloat16:none")
# The default model's matmuls: [out, in] of qkv, o, gate+up, down and the tied vocab head.
LAYER_SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "vocab": (49152, 576),
}


def build_engine(
    dtype: str, quantization: str, model: Path | None = None, int8: bool = False
) -> Engine:
    """The offline engine as `EngineArgs.create_engine` builds it, with `quantization` (and
    int8 activations with `int8`), on `model` (default: the default model)."""
    from kvrelay.engine.args import EngineArgs
    from kvrelay.models.loader import load_model
    from kvrelay.models.tokenizer import load_tokenizer
    from kvrelay_kernels import select_backend

    args = EngineArgs(dtype=dtype, model=str(model) if model else None)
    path = args.resolve_model_path()
    config = args.create_engine_config(path)
    model, _ = load_model(
        path,
        select_backend(config.attention_backend),
        dtype=getattr(torch, config.dtype),
        max_positions=config.max_model_len,
        device=config.device,
        quantization=quantization,
        int8_activations=int8,
    )
    model.prepack()
    return Engine(config, model, load_tokenizer(path))


def decode_step_ms(engine: Engine, tokens: int, repeats: int) -> float:
    """Median wall time of one decode step of a single greedy stream (first run is warm-up)."""
    from kvrelay import SamplingParams

    tokenizer: Any = engine.tokenizer
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    medians: list[float] = []
    for run in range(repeats + 1):
        engine.add_request(f"decode-{run}", prompt, params)
        engine.step()  # the prefill step is not a decode step
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        if run:
            medians.append(statistics.median(times))
    return 1000 * statistics.median(medians)


def greedy_tokens(engine: Engine, prompt: str, tokens: int) -> list[int]:
    from kvrelay import SamplingParams

    tokenizer: Any = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(f"greedy-{prompt}", tokenizer.encode(prompt), params)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            out = list(result.outputs[0].token_ids)
    return out


def teacher_forced_logits(model: CausalLM, ids: Sequence[int]) -> torch.Tensor:
    """`[T, vocab]` fp32 logits of every position of `ids`, one prefill in a fresh cache."""
    from kvrelay.models.inputs import AttentionInputs

    block_size, n = 16, len(ids)
    blocks = (n + block_size - 1) // block_size
    dtype = model.embed_tokens.weight.dtype
    cache = torch.zeros(model.kv_cache_shape(blocks, block_size), dtype=dtype)
    attn = AttentionInputs.build(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        block_size=block_size,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), cache, attn)
        return model.compute_logits(hidden)


def exactness(reference: Engine, candidate: Engine, tokens: int) -> dict[str, Any]:
    """Greedy agreement of `candidate` with `reference` over EXACT_PROMPTS."""
    tokenizer: Any = reference.tokenizer
    same_text, agree, total, max_err = 0, 0, 0, 0.0
    for prompt in EXACT_PROMPTS:
        ref = greedy_tokens(reference, prompt, tokens)
        got = greedy_tokens(candidate, prompt, tokens)
        same_text += ref == got
        ids = tokenizer.encode(prompt) + ref
        a = teacher_forced_logits(_model(reference), ids)
        b = teacher_forced_logits(_model(candidate), ids)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
        max_err = max(max_err, float((a - b).abs().max()))
    return {
        "prompts": len(EXACT_PROMPTS),
        "same_greedy_text": same_text,
        "top1_agreement": agree / total,
        "positions": total,
        "max_logit_error": max_err,
    }


def hf_agreement(engine: Engine, dtype: str, tokens: int) -> dict[str, Any]:
    """Greedy tokens of `engine` against transformers' on the same folder and dtype."""
    from transformers import AutoModelForCausalLM

    from kvrelay.models.default_model import default_model_dir

    hf = AutoModelForCausalLM.from_pretrained(
        default_model_dir(), torch_dtype=getattr(torch, dtype)
    )
    tokenizer: Any = engine.tokenizer
    same, agree, total = 0, 0, 0
    for prompt in EXACT_PROMPTS:
        ours = greedy_tokens(engine, prompt, tokens)
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        theirs = out[0, ids.shape[1] :].tolist()
        same += ours == theirs
        # Tokens equal up to the first divergence (after it the contexts differ).
        agree += next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours)
        )
        total += len(ours)
    return {"prompts": len(EXACT_PROMPTS), "same_greedy_text": same,
            "tokens_before_first_divergence": f"{agree}/{total}"}  # fmt: skip


def _model(engine: Engine) -> CausalLM:
    model = engine.runner.model
    assert isinstance(model, CausalLM)
    return model


def layer_table(repeats: int) -> list[str]:
    """Median µs per matmul of the model's shapes, every path side by side."""
    from kvrelay.models.gguf_blocks import dequantize_q8_0
    from kvrelay.models.layers import linear
    from kvrelay.models.quantized import Int4Linear, Q8_0Linear

    rows_out = ["| layer [out, in] | rows | fp32 dense | fp32 packed | bf16 dense | bf16 packed "
                "| Q4_1 torch int4 | Q4_1 as served | Q8_0 torch 2x int4 "
                "| Q8_0 as served | int8 per-row (not exact) | Q4_1 int8 act. | Q8_0 int8 act. |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in LAYER_SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        w16 = w.bfloat16()
        p32 = torch.ops.mkldnn._reorder_linear_weight(w)
        p16 = torch.ops.mkldnn._reorder_linear_weight(w16)
        raw, raw8 = _random_q4_1(n, k, gen), _random_q8_0(n, k, gen)
        q4, q8 = _both_kernels(Int4Linear, raw, k), _both_kernels(Q8_0Linear, raw8, k)
        # int8 activations (llama.cpp's scheme, not exact): the same blocks, integer dots.
        q4_int8 = Int4Linear(raw, k, None, torch.bfloat16, int8_activations=True)
        q8_int8 = Q8_0Linear(raw8, k, None, torch.bfloat16, int8_activations=True)
        int8, row_scales, err = _int8_per_row(dequantize_q8_0(raw8, k))
        print(f"{name}: int8 per-row requantization of Q8_0, largest weight error / row max "
              f"{err:.4f}", flush=True)  # fmt: skip
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k, generator=gen)
            x16 = x.bfloat16()
            calls = [
                partial(linear, x, w),
                partial(_packed, x, p32),
                partial(linear, x16, w16),
                partial(_packed, x16, p16),
                *(partial(layer, x16) for layer in (*q4, *q8)),
                partial(torch.ops.aten._weight_int8pack_mm, x16, int8, row_scales),
                partial(q4_int8, x16),
                partial(q8_int8, x16),
            ]
            cells = [_median_us(call, repeats) for call in calls]
            text = " | ".join(f"{c:.0f}" for c in cells)
            rows_out.append(f"| {name} [{n}, {k}] | {m} | {text} |")
            print(rows_out[-1], flush=True)
    return rows_out


def _both_kernels(kind: type[Any], raw: torch.Tensor, k: int) -> tuple[Any, Any]:
    """The layer over `raw` with torch's int4 kernel alone, and as served (kvrelay's block
    kernel where it builds)."""
    from kvrelay.models.quantized import QUANT_KERNEL_ENV

    before = os.environ.get(QUANT_KERNEL_ENV)
    layers = []
    for kernel in ("torch", "auto"):
        os.environ[QUANT_KERNEL_ENV] = kernel
        layers.append(kind(raw, k, None, torch.bfloat16))
    if before is None:  # the decode configurations run under the caller's choice
        del os.environ[QUANT_KERNEL_ENV]
    else:
        os.environ[QUANT_KERNEL_ENV] = before
    return layers[0], layers[1]


def _packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _random_q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[n, k / 32 * 20]` uint8 Q4_1 rows with small fp16 scales and mins."""
    blocks = k // 32
    consts = (torch.rand(n, blocks, 2, generator=gen) * 0.01).half().view(torch.uint8)
    codes = torch.randint(0, 256, (n, blocks, 16), generator=gen, dtype=torch.uint8)
    return torch.cat((consts.reshape(n, blocks, 4), codes), -1).reshape(n, blocks * 20)


def _random_q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[n, k / 32 * 34]` uint8 Q8_0 rows with small fp16 scales and every int8 code."""
    blocks = k // 32
    scales = (torch.rand(n, blocks, generator=gen) * 0.002).half().view(torch.uint8)
    codes = torch.randint(0, 256, (n, blocks, 32), generator=gen, dtype=torch.uint8)
    return torch.cat((scales.reshape(n, blocks, 2), codes), -1).reshape(n, blocks * 34)


def _int8_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`w` requantized for `_weight_int8pack_mm` (int8 codes, one bf16 scale per row), and
    the largest weight error relative to its row's largest weight."""
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    codes = torch.round(w / scale).clamp(-127, 127)
    scale16 = scale.bfloat16()
    err = ((codes * scale16.float() - w).abs() / (127 * scale)).max()
    return codes.to(torch.int8), scale16.flatten(), float(err)


def write_q8_0_twin(folder: Path) -> Path:
    """The default model's folder with every Q4_1 weight of its source GGUF requantized to
    Q8_0 (gguf's quantizer, GGUF row order kept: no rotary permutation to redo), and the
    dequantized weights as safetensors (the exact fp32 reference); written once."""
    if (folder / "model.safetensors").is_file():
        return folder
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
    from safetensors.torch import save_file

    from kvrelay.config import ModelConfig
    from kvrelay.models.default_model import SOURCE_GGUF, default_model_dir
    from kvrelay.models.gguf_convert import open_gguf, read_gguf_weights

    source = default_model_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix in (".json", ".jinja"):
            shutil.copy(item, folder / item.name)
    q8_0, q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1
    writer = GGUFWriter(str(folder / SOURCE_GGUF), "llama")
    for t in GGUFReader(source / SOURCE_GGUF).tensors:
        if t.tensor_type == q4_1:
            weight = quants.dequantize(t.data, q4_1)
            writer.add_tensor(t.name, quants.quantize(weight, q8_0), raw_dtype=q8_0)
        elif t.tensor_type == q8_0:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=q8_0)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelConfig.from_pretrained(folder)
    dense = read_gguf_weights(open_gguf(folder / SOURCE_GGUF), config.num_attention_heads,
                              config.num_key_value_heads, keep_quantized=frozenset())  # fmt: skip
    dense.pop("lm_head.weight", None)  # tied to the embedding, as in the source folder
    save_file({k: v.contiguous() for k, v in dense.items()}, str(folder / "model.safetensors"))
    return folder


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def llama_cpp_figure(gguf: Path, threads: int) -> str:
    """llama.cpp's 1-stream decode tok/s on `gguf` (llama-bench tg128), or why there is none."""
    found = shutil.which("llama-bench")
    if found is None:
        # Executable files only: a llama.cpp build tree also has a tools/llama-bench folder.
        cached = sorted(
            p
            for p in Path.home().joinpath(".cache").rglob("llama-bench")
            if p.is_file() and os.access(p, os.X_OK)
        )
        found = str(cached[0]) if cached else None
    if found is None:
        return "llama.cpp: not installed on this machine (no llama-bench on PATH or in ~/.cache)"
    cmd = [found, "-m", str(gguf), "-p", "0", "-n", "128", "-t", str(threads), "-o", "csv"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    return f"llama.cpp llama-bench tg128: {result.stdout.strip() or result.stderr.strip()}"


WEIGHTS = {"q4_1": "Q4_1", "q8_0": "Q8_0"}


def _folder(quantization: str, args: argparse.Namespace) -> Path | None:
    """The model folder a quantization is measured on: the Q8_0 twin for q8_0."""
    return write_q8_0_twin(args.q8_0_folder) if quantization == "q8_0" else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        nargs="*",
        default=list(CONFIGS),
        help="dtype:quantization[:int8] to decode with, :int8 for int8 activations "
        "(default: %(default)s)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (medians)")
    parser.add_argument("--layers", action="store_true", help="the per-layer matmul table")
    parser.add_argument("--exact", action="store_true", help="Q4_1, Q8_0 vs dequantized fp32")
    parser.add_argument(
        "--exact-formats",
        nargs="*",
        default=["q4_1", "q8_0"],
        choices=["q4_1", "q8_0"],
        help="which quantizations --exact checks (default: %(default)s)",
    )
    parser.add_argument(
        "--q8-0-folder",
        type=Path,
        default=Q8_0_FOLDER,
        help="where the default model's Q8_0 twin is written once (~700 MB; default %(default)s)",
    )
    parser.add_argument("--hf", action="store_true", help="bf16 greedy vs transformers' bf16")
    parser.add_argument("--exact-tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 keeps a shared machine's other load from "
        "stalling every parallel region (benchmarks/results/2026-11-30_quantized_decode_xeon.md "
        "is --threads 1)",
    )
    return parser


def decode_rows(args: argparse.Namespace) -> list[str]:
    """The decode table: one row per --configs entry, printed as it is measured."""
    rows = ["| weights | activations | ms / decode step | tok/s |", "|---|---|---|---|"]
    for spec in args.configs:
        dtype, _, rest = spec.partition(":")
        quantization, _, int8 = rest.partition(":")
        folder = _folder(quantization, args)
        engine = build_engine(dtype, quantization or "none", folder, int8=bool(int8))
        ms = decode_step_ms(engine, args.tokens, args.repeats)
        weights = WEIGHTS.get(quantization, dtype)
        activations = "int8 (not exact)" if int8 else dtype
        rows.append(f"| {weights} | {activations} | {ms:.1f} | {1000 / ms:.1f} |")
        print(rows[-1], flush=True)
        del engine
        gc.collect()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.layers:
        layer_table(repeats=50)
    rows = decode_rows(args)
    for quantization in args.exact_formats if args.exact else ():
        folder = _folder(quantization, args)
        reference = build_engine("float32", "none", folder)
        for dtype, int8 in (("float32", False), ("bfloat16", False), ("float32", True),
                            ("bfloat16", True)):  # fmt: skip
            candidate = build_engine(dtype, quantization, folder, int8)
            activations = "int8" if int8 else dtype
            print(f"{quantization.upper()} with {activations} activations vs dequantized fp32:",
                  exactness(reference, candidate, args.exact_tokens), flush=True)  # fmt: skip
            del candidate
            gc.collect()
    if args.hf:
        for dtype in ("bfloat16", "float32"):
            result = hf_agreement(build_engine(dtype, "none"), dtype, args.exact_tokens)
            print(f"kvrelay {dtype} vs transformers {dtype}: {result}", flush=True)
    from kvrelay.models.default_model import SOURCE_GGUF, default_model_dir

    print(llama_cpp_figure(default_model_dir() / SOURCE_GGUF, torch.get_num_threads()))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
