#!/usr/bin/env python
"""kvrelay's C++ CPU decode attention against the torch reference (gather + SDPA), same run.

One query token per sequence over the paged, block-major KV cache with shuffled block tables,
in the default model's head shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16, 30
layers); median microseconds per layer call and the ratio, fp32 and bf16. Each timed call
sweeps every layer in turn, as a decode step does: a step's keys and values do not fit in the
CPU's caches, so this is the time a step sees (with its KV read rate). "one layer again" is the
kernel on one layer called back to back, its keys and values in cache: the arithmetic alone.
`--sliding-window` and `--soft-cap` time a windowed or capped layer (Mistral, Gemma 2 and 3):
the kernel reads only the window's blocks, so the read rate counts the window's keys.

    .venv/bin/python benchmarks/cpu_attention.py --threads 1
    .venv/bin/python benchmarks/cpu_attention.py --shapes 16x1024,64x512 --repeats 31
    .venv/bin/python benchmarks/cpu_attention.py --shapes 16x4096 --sliding-window 256
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kernels.paged_batch

from tests.kernels.paged_batch import make_paged_batch

from kvrelay_kernels import build_plan, cpu_backend, reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--shapes", default="1x256,16x256,16x1024", help="SEQSxCONTEXT,... (default: %(default)s)")
    add_case_args(parser)
    add("--layers", type=int, default=30, help="layers in the cache, swept per timed call")
    add("--sliding-window", type=int, default=None, help="keys each decode sees (default: all)")
    add("--soft-cap", type=float, default=None, help="attention-logit soft cap (default: none)")
    return parser


def add_case_args(parser: argparse.ArgumentParser) -> None:
    """The flags every CPU attention benchmark takes (this one, cpu_prefill_attention.py):
    dtypes, repeats, threads and the head shape, the default model's by default."""
    add = parser.add_argument
    add("--dtypes", default="float32,bfloat16", help="comma-separated (default: %(default)s)")
    add("--repeats", type=int, default=15, help="timed calls per case (median)")
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--kv-heads", type=int, default=3)
    add("--group", type=int, default=3, help="query heads per KV head")
    add("--head-dim", type=int, default=64)
    add("--block-size", type=int, default=16)


def check_variants(args: argparse.Namespace) -> None:
    """Exit naming the flag when --sliding-window or --soft-cap is out of its domain."""
    if args.sliding_window is not None and args.sliding_window < 1:
        raise SystemExit(f"--sliding-window must be >= 1, got {args.sliding_window}")
    if args.soft_cap is not None and not 0 < args.soft_cap < float("inf"):
        raise SystemExit(f"--soft-cap must be a finite number > 0, got {args.soft_cap}")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`16x1024,1x256` -> [(16, 1024), (1, 256)]."""
    shapes = []
    for part in text.split(","):
        seqs, sep, context = part.strip().partition("x")
        if not sep or not seqs.isdigit() or not context.isdigit():
            raise SystemExit(f"--shapes: {part!r} is not SEQSxCONTEXT (e.g. 16x1024)")
        shapes.append((int(seqs), int(context)))
    return shapes


def keys_read(context: int, sliding_window: int | None) -> int:
    """Keys the kernel reads for a decode of `context` tokens: the window's only."""
    return min(context, sliding_window or context)


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (and the kernel's build on its first call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(args: argparse.Namespace, seqs: int, context: int, dtype: torch.dtype) -> str:
    """One table row: per layer, the kernel's and the reference's median over a sweep of
    every layer, their ratio, the kernel's KV read rate, and the kernel on one cached layer."""
    batch = make_paged_batch(
        [context] * seqs,
        [1] * seqs,
        args.block_size,
        args.kv_heads,
        args.group,
        args.head_dim,
        num_layers=args.layers,
    )
    query, kv_cache = batch.query.to(dtype), batch.kv_cache.to(dtype)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, args.block_size)
    scale = args.head_dim**-0.5
    variant = {"sliding_window": args.sliding_window, "soft_cap": args.soft_cap}

    def sweep(attention: Callable[..., object]) -> Callable[[], object]:
        def every_layer() -> None:
            for layer in range(args.layers):
                attention(query, kv_cache, layer, tables, lens, qsl, scale, plan=plan, **variant)

        return every_layer

    kernel = median_us(sweep(cpu_backend.paged_attention), args.repeats) / args.layers
    ref = median_us(sweep(reference.paged_attention), args.repeats) / args.layers
    one_layer = functools.partial(cpu_backend.paged_attention, query, kv_cache, 0, tables)
    cached = median_us(lambda: one_layer(lens, qsl, scale, plan=plan, **variant), args.repeats)
    kv_bytes = (
        seqs
        * keys_read(context, args.sliding_window)
        * 2
        * args.kv_heads
        * args.head_dim
        * kv_cache.element_size()
    )
    name = str(dtype).removeprefix("torch.")
    return (
        f"| {seqs} x {context} | {name} | {kernel:.0f} | {ref:.0f} | {ref / kernel:.2f}x "
        f"| {kv_bytes / kernel / 1e3:.1f} | {cached:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_variants(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_backend.is_available():
        print("the CPU kernel does not build here (no C++ compiler?)")
        return 1
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.layers} layers swept per call; microseconds per layer")
    print(f"sliding window: {args.sliding_window or 'none'}, soft cap: {args.soft_cap or 'none'}")
    print(
        "| sequences x context | dtype | kernel us | reference us | speed-up "
        "| kernel KV read GB/s | kernel, one layer again, us |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for seqs, context in parse_shapes(args.shapes):
        for dtype in dtypes:
            print(measure(args, seqs, context, dtype), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
