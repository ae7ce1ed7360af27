#!/usr/bin/env python
"""Many-row bf16 matmuls: kvrelay's blocked kernel against oneDNN (torch's linear on the dense
weight; AMX tiles where the CPU has them), and what the measured choice does to the first
token (models/many_rows.py, issue 42).

Three parts, in one run:
  shapes   the default model's weight shapes at 1-512 rows: fastest-of-5 µs per path, taking
           turns, and the path `auto` would pick from those timings.
  ttft     a 128-token prompt at 1 stream through the offline engine, bf16, one engine per
           KVRELAY_CPU_MANY_ROWS value, the values taking turns round after round (a fresh
           prompt each round: no prefix-cache hits); median ms to the first token.
  profile  where a 128-token prefill's time goes on today's path (`blocked`), by op class,
           from cProfile's own-time per function.

    .venv/bin/python benchmarks/many_rows.py
    .venv/bin/python benchmarks/many_rows.py --rounds 11 --paths blocked auto onednn
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import statistics
import subprocess
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kvrelay import SamplingParams
from kvrelay.llm import LLM
from kvrelay.models.cpu_features import cpu_feature_summary
from kvrelay.models.layers import Linear, PackedLinear, blocked_of, run_blocked
from kvrelay.models.many_rows import (
    MANY_ROWS_ENV,
    NEVER,
    _time_pair,
    confirmed_crossover,
)

# SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536, vocab 49152.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "vocab": (49152, 576),
}
ROWS = (1, 4, 16, 64, 128, 256, 512)
PROMPT_TOKENS = 128


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=9, help="TTFT turns of each path")
    parser.add_argument("--paths", nargs="+", default=["blocked", "auto", "onednn"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["shapes", "ttft", "profile"])
    return parser


def header() -> list[str]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return [
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {commit}",
        f"CPU {cpu_feature_summary()}",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f} at start",
    ]


def shapes_table() -> list[str]:
    lines = [
        "| shape | [out, in] | rows | blocked µs | oneDNN µs | oneDNN/blocked | auto takes "
        "| oneDNN packed copy µs |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features).bfloat16()
        timings, packed_s = shape_timings(weight)
        crossover = timings_crossover(timings, weight)
        for rows, (blocked_s, onednn_s) in timings.items():
            takes = "oneDNN" if rows >= crossover else "blocked"
            lines.append(
                f"| {name} | [{out_features}, {in_features}] | {rows} | {1e6 * blocked_s:.0f} | "
                f"{1e6 * onednn_s:.0f} | {onednn_s / blocked_s:.2f} | {takes} "
                f"| {1e6 * packed_s[rows]:.0f} |"
            )
    return lines


def shape_timings(
    weight: torch.Tensor,
) -> tuple[dict[int, tuple[float, float]], dict[int, float]]:
    """Per row count: (blocked, oneDNN on the dense weight) seconds, taking turns; and
    oneDNN on its own packed copy (`PackedLinear`, the layout kvrelay does not keep), timed
    in turns with the dense one."""
    blocked = blocked_of(weight, None)
    packed = PackedLinear(weight, None)
    timings: dict[int, tuple[float, float]] = {}
    packed_s: dict[int, float] = {}
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1]).bfloat16()
        with torch.inference_mode():
            timings[rows] = _time_pair(
                partial(run_blocked, blocked, x), partial(F.linear, x, weight)
            )
            packed_s[rows] = _time_pair(partial(packed.forward, x), partial(F.linear, x, weight))[0]
    return timings, packed_s


def timings_crossover(timings: dict[int, tuple[float, float]], weight: torch.Tensor) -> int:
    """What `auto` picks from `timings` (multi-row counts, oneDNN's wins timed again and
    `timings` updated with the faster of both rounds)."""
    many = {rows: t for rows, t in timings.items() if rows > 1}
    with torch.inference_mode():
        crossover = confirmed_crossover(
            many, weight.shape[1], partial(run_blocked, blocked_of(weight, None)),
            partial(F.linear, weight=weight),
        )  # fmt: skip
    timings.update(many)
    return crossover


def new_engine(model: str | None, path: str) -> LLM:
    os.environ[MANY_ROWS_ENV] = path  # read when the model is packed, at load
    return LLM(model, dtype="bfloat16", kv_cache_memory="256MiB")


def crossovers(llm: LLM) -> str:
    """Each weight shape's row count from which the engine's model takes oneDNN."""
    model: Any = llm.engine.runner.model
    found = {tuple(m.weight.shape): m.onednn_from_rows for m in model.modules()
             if isinstance(m, Linear)}  # fmt: skip
    cells = [f"{list(s)}: {'never' if rows == NEVER else rows}" for s, rows in found.items()]
    return ", ".join(cells)


def prompt_ids(llm: LLM, seed: int) -> list[int]:
    vocab = llm.get_tokenizer().vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (PROMPT_TOKENS,), generator=gen).tolist()


def ttft_ms(llm: LLM, prompt: list[int], request_id: str) -> float:
    """Wall ms from adding the request to the step that returns its first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * (time.perf_counter() - start)


def ttft_table(engines: dict[str, LLM], rounds: int) -> list[str]:
    times: dict[str, list[float]] = {path: [] for path in engines}
    for turn in range(rounds + 1):
        for path, llm in engines.items():
            ms = ttft_ms(llm, prompt_ids(llm, turn), f"{path}-{turn}")
            if turn:  # the first round warms up
                times[path].append(ms)
    lines = [f"| {MANY_ROWS_ENV} | TTFT median ms | min | max |", "|---|---:|---:|---:|"]
    for path, samples in times.items():
        lines.append(
            f"| {path} | {statistics.median(samples):.1f} | {min(samples):.1f} | "
            f"{max(samples):.1f} |"
        )
    return lines


# cProfile's function names -> op class; the first match wins, the rest is host time (Python,
# tensor bookkeeping, scheduling). kvrelay's C++ kernels show as built-ins named by function.
CLASSES = (
    ("matmuls", ("blocked_matmul", "linear", "_linear_pointwise", "matmul", "addmm")),
    ("rope / kv write", ("rope", "rotary", "cos_sin", "write_kv", "reshape_and_cache")),
    ("attention", ("attention", "_chunk_attention", "sdpa", "flash")),
    ("norms", ("rms_norm", "add_rms_norm")),
    ("activation", ("silu_and_mul", "silu", "gelu")),
    ("sampling / logits", ("sample", "logits", "argmax", "softmax", "topk", "top_k")),
)


def classify(function: tuple[str, int, str]) -> str:
    """The op class of a cProfile entry `(file, line, name)`."""
    name = function[2].lower()
    for op_class, keys in CLASSES:
        if any(key in name for key in keys):
            return op_class
    return "host"


def profile_table(llm: LLM, runs: int) -> list[str]:
    profiler = cProfile.Profile()
    wall = 0.0
    for i in range(runs):
        prompt = prompt_ids(llm, 1000 + i)
        profiler.enable()
        wall += ttft_ms(llm, prompt, f"profile-{i}")
        profiler.disable()
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    per_class: dict[str, float] = {}
    for function, (_, _, own_s, _, _) in stats.items():
        op_class = classify(function)
        per_class[op_class] = per_class.get(op_class, 0.0) + own_s
    total = sum(per_class.values())
    lines = [
        f"{runs} prefills of {PROMPT_TOKENS} tokens, {wall / runs:.1f} ms each (profiled)",
        "| op class | ms per prefill | share |",
        "|---|---:|---:|",
    ]
    for op_class, own_s in sorted(per_class.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {op_class} | {1000 * own_s / runs:.1f} | {own_s / total:.0%} |")
    return lines


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("\n".join(header()))
    if "shapes" not in args.skip:
        print("\nbf16 matmul per shape and row count (fastest of 5, taking turns):")
        print("\n".join(shapes_table()))
    if "ttft" in args.skip and "profile" in args.skip:
        return
    engines = {}
    for path in args.paths:
        start = time.perf_counter()
        engines[path] = new_engine(args.model, path)
        load_s = time.perf_counter() - start  # `auto` includes its measurement
        print(f"{MANY_ROWS_ENV}={path}: loaded in {load_s:.1f} s; oneDNN from rows "
              f"{crossovers(engines[path])}")  # fmt: skip
    if "ttft" not in args.skip:
        print(f"\nTTFT of a {PROMPT_TOKENS}-token prompt, 1 stream, bf16, {args.rounds} rounds:")
        print("\n".join(ttft_table(engines, args.rounds)))
    if "profile" not in args.skip:
        first = next(iter(engines.values()))
        print(f"\nWhere a prefill's time goes ({args.paths[0]}), cProfile own time:")
        print("\n".join(profile_table(first, 5)))


if __name__ == "__main__":
    main()
