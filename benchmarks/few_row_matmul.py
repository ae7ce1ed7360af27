#!/usr/bin/env python
"""kvrelay's few-row dense kernel (csrc_cpu/dense_gemv.cpp) against oneDNN's packed matmul and
`linear`, on the default model's weights, and what it does to a decode step.

Two parts, per dtype, in one run:
  layers   the model's 120 matmuls in the order a step runs them (their weights far beyond
           the caches, as in a step), at 1-16 rows: median ms per sweep and the weights' read
           rate, each path in turn, round after round.
  decode   the offline engine decodes 1 and 4 greedy streams; the median decode step with the
           kernel bound (as kvrelay runs) and unbound (oneDNN / `linear`), taking turns.

    .venv/bin/python benchmarks/few_row_matmul.py
    .venv/bin/python benchmarks/few_row_matmul.py --dtypes bfloat16 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from kvrelay import SamplingParams
from kvrelay.llm import LLM
from kvrelay.models.layers import Linear, linear
from kvrelay.models.llama import CausalLM
from serving.decode_steps import decode_step_ms

PROMPT = "The history of the printing press begins"
ROWS = (1, 2, 4, 8, 16)


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


def layer_paths(layers: list[Linear]) -> dict[str, Callable[[Linear, torch.Tensor], object]]:
    paths: dict[str, Callable[[Linear, torch.Tensor], object]] = {}
    if all(layer.few_rows is not None for layer in layers):
        paths["kvrelay"] = lambda layer, x: layer.few_rows[0](x, *layer.few_rows[1:3])  # type: ignore[index]
    if all(layer.packed is not None for layer in layers):
        paths["oneDNN packed"] = lambda layer, x: layer.packed.forward(x)  # type: ignore[union-attr]
    paths["linear"] = lambda layer, x: linear(x, layer.weight, layer.bias)
    return paths


def layers_table(llm: LLM, dtype: str, rounds: int) -> list[str]:
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    nbytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    paths = layer_paths(layers)
    lines = []
    for rows in tqdm(ROWS, desc=f"{dtype} layers", unit="row count"):
        inputs = [torch.randn(rows, layer.in_features).to(layer.weight.dtype) for layer in layers]
        times: dict[str, list[float]] = {name: [] for name in paths}
        for turn in range(rounds + 1):
            for name, path in paths.items():
                start = time.perf_counter()
                for layer, x in zip(layers, inputs, strict=True):
                    path(layer, x)
                if turn:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        cells = []
        for name in paths:
            seconds = statistics.median(times[name])
            cells.append(f"{name} {1000 * seconds:.2f} ms ({nbytes / seconds / 1e9:.1f} GB/s)")
        lines.append(f"| {dtype} | {rows} | " + " | ".join(cells) + " |")
    return lines


@contextlib.contextmanager
def unbound(model: CausalLM) -> Iterator[None]:
    """The model without kvrelay's few-row kernel (oneDNN and `linear` only), for a while."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    saved = [layer.few_rows for layer in layers], model.few_row_logits
    for layer in layers:
        layer.few_rows = None
    model.few_row_logits = None
    try:
        yield
    finally:
        for layer, few in zip(layers, saved[0], strict=True):
            layer.few_rows = few
        model.few_row_logits = saved[1]


def decode_table(llm: LLM, dtype: str, rounds: int, tokens: int) -> list[str]:
    model = llm.engine.runner.model
    prompt = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    lines = []
    for streams in (1, 4):
        times: dict[str, list[float]] = {"kvrelay": [], "without": []}
        for turn in tqdm(range(rounds + 1), desc=f"{dtype} decode x{streams}", unit="round"):
            with_kernel = decode_step_ms(llm.engine, prompt, params, f"a{turn}", streams)
            with unbound(model):
                without = decode_step_ms(llm.engine, prompt, params, f"b{turn}", streams)
            if turn:
                times["kvrelay"].append(with_kernel)
                times["without"].append(without)
        ours, theirs = (statistics.median(times[k]) for k in ("kvrelay", "without"))
        lines.append(f"| {dtype} | {streams} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |")
    return lines


def main() -> None:
    args = build_parser().parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    layer_lines: list[str] = []
    decode_lines: list[str] = []
    for dtype in args.dtypes:
        llm = LLM(args.model, dtype=dtype, kv_cache_memory="256MiB")
        layer_lines += layers_table(llm, dtype, args.rounds)
        if not args.skip_decode:
            decode_lines += decode_table(llm, dtype, args.rounds, args.tokens)
        del llm
    print("\nThe model's matmuls, one step's worth, in model order (median ms per sweep):")
    print("| dtype | rows | paths |\n|---|---:|---|")
    print("\n".join(layer_lines))
    if decode_lines:
        print("\nDecode step (median ms), the few-row kernel bound or not, taking turns:")
        print("| dtype | streams | with kernel | oneDNN / linear | speed-up |")
        print("|---|---:|---:|---:|---:|")
        print("\n".join(decode_lines))


if __name__ == "__main__":
    main()
