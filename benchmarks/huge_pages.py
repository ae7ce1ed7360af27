#!/usr/bin/env python
"""What the weights' layout and 2 MiB pages do to one stream's decode step on the CPU.

Three engines of the same model are built in this process and take turns decoding one
greedy stream, round after round (a shared host's speed drifts by 20-40% within minutes;
turns keep the three comparable):
  as loaded      each weight where the loader's allocations put it, 4 KiB pages (kvrelay
                 before `models/weight_arena.py`), KV cache on 4 KiB pages
  gathered 4K    the weights in one allocation in module order, 4 KiB pages
                 (KVRELAY_HUGE_PAGES=0)
  gathered 2M    the same on 2 MiB pages, and the KV cache too (the default)
(bf16 and fp32 matmuls on an AVX-512 CPU read the packed copies that `CausalLM.prepack` always
packs into one allocation: for them the layouts differ only in pages.)
Per configuration the table gives the median decode step of each and its ratio to "as
loaded"; the process's AnonHugePages shows whether Linux did map huge pages.

    .venv/bin/python benchmarks/huge_pages.py
    .venv/bin/python benchmarks/huge_pages.py --configs bfloat16:q4_1:int8 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvrelay import SamplingParams
from kvrelay.llm import LLM
from kvrelay_kernels.host_memory import HUGE_PAGES_ENV
from serving.decode_steps import decode_step_ms

PROMPT = "The history of the printing press begins"
LAYOUTS = ("as loaded", "gathered 4K", "gathered 2M")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["bfloat16:q4_1:int8", "bfloat16", "float32"],
        help="dtype[:quantization[:int8]] each (default: %(default)s)",
    )
    parser.add_argument("--tokens", type=int, default=200, help="decode steps per turn")
    parser.add_argument("--rounds", type=int, default=7, help="turns of each engine")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    return parser


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    """The loader and the KV allocation as `name` has them, while an engine is built."""
    saved = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = "1" if name == "gathered 2M" else "0"
    patch = contextlib.nullcontext()
    if name == "as loaded":
        import kvrelay.models.loader as loader

        patch = _patched(loader, "gather_weights", lambda model: 0)
    try:
        with patch:
            yield
    finally:
        if saved is None:
            os.environ.pop(HUGE_PAGES_ENV, None)
        else:
            os.environ[HUGE_PAGES_ENV] = saved


@contextlib.contextmanager
def _patched(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    original = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def engine_args(config: str) -> dict[str, Any]:
    dtype, *rest = config.split(":")
    args: dict[str, Any] = {"dtype": dtype, "kv_cache_memory": "256MiB"}
    if rest:
        args["quantization"] = rest[0]
    if rest[1:] == ["int8"]:
        args["int8_activations"] = True
    return args


def anon_huge_pages_mb() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(model: str | None, config: str, tokens: int, rounds: int) -> dict[str, float]:
    engines = {}
    for name in LAYOUTS:
        with layout(name):
            engines[name] = LLM(model, **engine_args(config))
    prompt = engines[LAYOUTS[0]].get_tokenizer().encode(PROMPT)
    huge_mb = anon_huge_pages_mb()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for turn in tqdm(range(rounds + 1), desc=config, unit="round"):
        for name, llm in engines.items():
            step = decode_step_ms(llm.engine, prompt, params, f"turn-{turn}")
            if turn:  # the first round warms caches and oneDNN's primitives
                times[name].append(step)
    del engines
    gc.collect()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {**medians, "huge_mb": huge_mb}


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens")
    rows = [
        (config, measure(args.model, config, args.tokens, args.rounds)) for config in args.configs
    ]
    head = " | ".join(f"{name} (ms)" for name in LAYOUTS)
    print(f"| config | {head} | 2M / as loaded | 4K / as loaded | AnonHugePages (MB) |")
    print("|---|" + "---:|" * (len(LAYOUTS) + 3))
    for config, row in rows:
        steps = " | ".join(f"{row[name]:.2f}" for name in LAYOUTS)
        base = row["as loaded"]
        print(
            f"| {config} | {steps} | {row['gathered 2M'] / base:.2f}x | "
            f"{row['gathered 4K'] / base:.2f}x | {row['huge_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
