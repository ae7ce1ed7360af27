#!/usr/bin/env python
"""kvrelay's blocked dense kernel (csrc_cpu/blocked_matmul.cpp) against oneDNN's packed matmul
and `linear`, on the default model's weights, and what it does to a decode step.

Two parts, per dtype, in one run:
  layers   the model's 120 matmuls in the order a step runs them (their weights far beyond
           the caches, as in a step), from a decode step's 1 row to a prefill chunk's 512:
           median ms per sweep and GFLOP/s, each path in turn, round after round.
  decode   the offline engine decodes 1, 4 and 16 greedy streams; the median decode step on
           the blocked kernel (as kvrelay runs) and on oneDNN's packed copies, taking turns.

    .venv/bin/python benchmarks/blocked_matmul.py
    .venv/bin/python benchmarks/blocked_matmul.py --dtypes bfloat16 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from kvrelay import SamplingParams
from kvrelay.llm import LLM
from kvrelay.models.layers import Linear, PackedLinear, linear
from kvrelay.models.llama import CausalLM
from kvrelay.models.many_rows import MANY_ROWS_ENV
from serving.decode_steps import decode_step_ms

PROMPT = "The history of the printing press begins"
ROWS = (1, 2, 4, 8, 16, 32, 64, 512)
STREAMS = (1, 4, 16)

Path = Callable[[Linear, torch.Tensor], object]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=7, help="turns of each path")
    parser.add_argument("--tokens", type=int, default=128, help="decode steps per stream")
    parser.add_argument("--skip-decode", action="store_true", help="the layers part only")
    return parser


def onednn_copies(model: CausalLM) -> dict[int, PackedLinear]:
    """oneDNN's packed copy of every matmul weight, the tied vocab projection's included
    (kvrelay makes none where its kernel builds), keyed by the weight's id."""
    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, Linear)]
    if model.lm_head is None:
        weights.append((model.embed_tokens.weight, None))
    return {id(weight): PackedLinear(weight, bias) for weight, bias in weights}


def layer_paths(layers: list[Linear], onednn: dict[int, PackedLinear]) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    if all(layer.blocked is not None for layer in layers):
        paths["kvrelay blocked"] = lambda layer, x: layer.forward(x)
    paths["oneDNN packed"] = lambda layer, x: onednn[id(layer.weight)].forward(x)
    paths["linear"] = lambda layer, x: linear(x, layer.weight, layer.bias)
    return paths


def layers_table(llm: LLM, dtype: str, rounds: int, onednn: dict[int, PackedLinear]) -> list[str]:
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    flops_per_row = 2 * sum(layer.weight.numel() for layer in layers)
    paths = layer_paths(layers, onednn)
    lines = []
    for rows in tqdm(ROWS, desc=f"{dtype} layers", unit="row count"):
        inputs = [torch.randn(rows, layer.in_features).to(layer.weight.dtype) for layer in layers]
        times: dict[str, list[float]] = {name: [] for name in paths}
        for turn in range(rounds + 1):
            for name, path in paths.items():
                if name == "linear" and rows > 64:
                    continue  # minutes of `F.linear` at 512 rows tell nothing new
                start = time.perf_counter()
                for layer, x in zip(layers, inputs, strict=True):
                    path(layer, x)
                if turn:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        cells = []
        for name, samples in times.items():
            if samples:
                seconds = statistics.median(samples)
                gflops = flops_per_row * rows / seconds / 1e9
                cells.append(f"{name} {1000 * seconds:.2f} ms ({gflops:.0f} GFLOP/s)")
        lines.append(f"| {dtype} | {rows} | " + " | ".join(cells) + " |")
    return lines


@contextlib.contextmanager
def on_onednn(model: CausalLM, onednn: dict[int, PackedLinear]) -> Iterator[None]:
    """The model on oneDNN's packed copies instead of kvrelay's blocked kernel, for a while."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    saved = [(layer.blocked, layer.packed) for layer in layers]
    saved_logits = model.blocked_logits, model.packed_logits
    for layer in layers:
        layer.blocked, layer.packed = None, onednn[id(layer.weight)]
    if model.lm_head is None:
        model.blocked_logits = None
        model.packed_logits = onednn[id(model.embed_tokens.weight)]
    try:
        yield
    finally:
        for layer, (blocked, packed) in zip(layers, saved, strict=True):
            layer.blocked, layer.packed = blocked, packed
        model.blocked_logits, model.packed_logits = saved_logits


def decode_table(
    llm: LLM, dtype: str, rounds: int, tokens: int, onednn: dict[int, PackedLinear]
) -> list[str]:
    model = llm.engine.runner.model
    prompt = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    lines = []
    for streams in STREAMS:
        times: dict[str, list[float]] = {"kvrelay": [], "oneDNN": []}
        for turn in tqdm(range(rounds + 1), desc=f"{dtype} decode x{streams}", unit="round"):
            ours = decode_step_ms(llm.engine, prompt, params, f"a{turn}", streams)
            with on_onednn(model, onednn):
                theirs = decode_step_ms(llm.engine, prompt, params, f"b{turn}", streams)
            if turn:
                times["kvrelay"].append(ours)
                times["oneDNN"].append(theirs)
        ours, theirs = (statistics.median(times[k]) for k in ("kvrelay", "oneDNN"))
        lines.append(f"| {dtype} | {streams} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |")
    return lines


def main() -> None:
    args = build_parser().parse_args()
    # "kvrelay blocked" means the kernel at every row count: not oneDNN from a measured
    # crossover (benchmarks/many_rows.py compares those).
    os.environ[MANY_ROWS_ENV] = "blocked"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    layer_lines: list[str] = []
    decode_lines: list[str] = []
    for dtype in args.dtypes:
        llm = LLM(args.model, dtype=dtype, kv_cache_memory="256MiB")
        onednn = onednn_copies(llm.engine.runner.model)
        layer_lines += layers_table(llm, dtype, args.rounds, onednn)
        if not args.skip_decode:
            decode_lines += decode_table(llm, dtype, args.rounds, args.tokens, onednn)
        del llm, onednn
    print("\nThe model's matmuls, one step's worth, in model order (median ms per sweep):")
    print("| dtype | rows | paths |\n|---|---:|---|")
    print("\n".join(layer_lines))
    if decode_lines:
        print("\nDecode step (median ms), kvrelay's blocked kernel or oneDNN, taking turns:")
        print("| dtype | streams | blocked kernel | oneDNN packed | speed-up |")
        print("|---|---:|---:|---:|---:|")
        print("\n".join(decode_lines))


if __name__ == "__main__":
    main()
