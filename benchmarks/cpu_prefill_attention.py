#!/usr/bin/env python
"""kvrelay's C++ CPU prefill attention against the torch reference (gather + SDPA), same run.

A prompt's (or a chunk's) causal attention over the paged, block-major KV cache with shuffled
block tables, in the default model's head shape (9 query heads, 3 KV heads, head_dim 64, blocks
of 16); median microseconds per layer call, the ratio, and the whole prefill's attention over
--layers layers. `PROMPT` is a whole prompt; `PROMPTxCONTEXT` a chunk of PROMPT rows after
CONTEXT - PROMPT computed tokens (chunked prefill, a cached prefix).

    .venv/bin/python benchmarks/cpu_prefill_attention.py --threads 2
    .venv/bin/python benchmarks/cpu_prefill_attention.py --shapes 512,256x2048 --repeats 31
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kernels.paged_batch
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_attention, run or loaded

from tests.kernels.paged_batch import make_paged_batch

from cpu_attention import add_case_args, median_us
from kvrelay_kernels import build_plan, cpu_prefill, reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--shapes", default="128,512,128x640", help="PROMPT[xCONTEXT],... (default: %(default)s)")
    add_case_args(parser)
    add("--layers", type=int, default=30, help="layers the prefill's total counts")
    return parser


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`128,128x640` -> [(128, 128), (128, 640)]: (query rows, context)."""
    shapes = []
    for part in text.split(","):
        rows, _, context = part.strip().partition("x")
        context = context or rows
        if not rows.isdigit() or not context.isdigit() or not 0 < int(rows) <= int(context):
            raise SystemExit(
                f"--shapes: {part!r} is not PROMPT or PROMPTxCONTEXT (rows <= context)"
            )
        shapes.append((int(rows), int(context)))
    return shapes


def measure(args: argparse.Namespace, rows: int, context: int, dtype: torch.dtype) -> str:
    """One table row: the kernel's and the reference's median per layer, their ratio, and the
    kernel's attention time for the whole prefill (every layer)."""
    batch = make_paged_batch(
        [context], [rows], args.block_size, args.kv_heads, args.group, args.head_dim, num_layers=1
    )
    query, kv_cache = batch.query.to(dtype), batch.kv_cache.to(dtype)
    plan = build_plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, args.block_size)
    scale = args.head_dim**-0.5
    out = torch.empty_like(query)

    def timed(attention: Callable[..., None]) -> float:
        return median_us(lambda: attention(query, kv_cache, 0, plan, scale, out), args.repeats)

    kernel = timed(cpu_prefill.prefill_attention)
    ref = timed(reference.prefill_attention)
    name = str(dtype).removeprefix("torch.")
    return (
        f"| {rows} x {context} | {name} | {kernel:.0f} | {ref:.0f} | {ref / kernel:.2f}x "
        f"| {kernel * args.layers / 1e3:.1f} | {ref * args.layers / 1e3:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shapes = parse_shapes(args.shapes)
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_prefill.load_extension() is None:
        print("the CPU prefill kernel does not build here (no C++ compiler?)")
        return 1
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; microseconds per layer")
    print(
        "| query rows x context | dtype | kernel us | reference us | speed-up "
        f"| kernel, {args.layers} layers, ms | reference, {args.layers} layers, ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for rows, context in shapes:
        for dtype in dtypes:
            print(measure(args, rows, context, dtype), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
