#!/usr/bin/env python
"""Decode attention on a GPU: kvrelay's CUDA kernel, its Triton kernel, a gather + SDPA
reference and PyTorch FlexAttention with a paged block mask, each as a share of the device's
measured copy bandwidth (bytes of K and V read / time, over copy bandwidth).

Shapes: batch 1/16/64/256 x context 512/2048/8192, SmolLM2-shaped (9 query / 3 KV heads x 64)
and Llama-8B-shaped (32 / 8 x 128), bf16, block size 16, shuffled block tables. Times are
medians of `triton.testing.do_bench` (L2 flushed between runs). Run by benchmarks/gpu_check.sh.

    python benchmarks/gpu_decode_bench.py --json out.json     # needs CUDA
    python benchmarks/gpu_decode_bench.py --dry-run           # lists the shapes, any machine
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

METHODS = ("cuda", "triton", "sdpa", "flex")


@dataclass(frozen=True)
class Shape:
    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int

    def kv_bytes(self, elem: int) -> int:
        """Bytes of K and V one decode step reads."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * elem


@dataclass
class Result:
    shape: Shape
    us: dict[str, float] = field(default_factory=dict)  # method -> median microseconds
    errors: dict[str, str] = field(default_factory=dict)

    def percent(self, method: str, copy_gbps: float, elem: int) -> float | None:
        if method not in self.us:
            return None
        gbps = self.shape.kv_bytes(elem) / (self.us[method] * 1e-6) / 1e9
        return 100.0 * gbps / copy_gbps


MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


def shapes(batches: list[int], contexts: list[int]) -> list[Shape]:
    """Largest first: if the time budget runs out, the shapes the targets are about (batch
    >= 64, context >= 2048) have been measured already."""
    planned = [
        Shape(name, h, kvh, d, b, c)
        for b in sorted(batches, reverse=True)
        for c in sorted(contexts, reverse=True)
        for name, (h, kvh, d) in MODELS.items()
    ]
    return planned


def paged_block_mask(page_tables: torch.Tensor, total_tokens: int, page: int) -> Any:
    """FlexAttention's BlockMask for one query token per sequence over a shared physical KV
    of `total_tokens` tokens: sequence b reads exactly the pages `page_tables[b]`.

    The pages are listed as full blocks, so the compiled kernel visits only them and never
    evaluates the mask_mod; the mask_mod states the same ownership for flex's eager path,
    which ignores block indices.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, pages = page_tables.shape
    dev = page_tables.device
    owner = torch.full((total_tokens // page,), -1, dtype=torch.int64, device=dev)
    owner[page_tables.flatten().long()] = torch.arange(batch, device=dev).repeat_interleave(pages)

    def owns(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return owner[kv_idx // page] == b

    num = torch.full((batch, 1, 1), pages, dtype=torch.int32, device=dev)
    # Flex expects one index row as long as the KV has blocks; entries past `num` are unused.
    idx = torch.zeros(batch, 1, 1, total_tokens // page, dtype=torch.int32, device=dev)
    idx[..., :pages] = page_tables.to(torch.int32).view(batch, 1, 1, pages)
    return BlockMask.from_kv_blocks(
        torch.zeros_like(num),
        torch.zeros_like(idx),
        full_kv_num_blocks=num,
        full_kv_indices=idx,
        BLOCK_SIZE=page,
        mask_mod=owns,
        seq_lengths=(1, total_tokens),
    )


def median_us(fn: Callable[[], object]) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e3
    except ImportError:  # CUDA events, L2 not flushed
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB: (read + written bytes) / median time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6) / 1e9


def bench_shape(shape: Shape, dtype: torch.dtype, methods: list[str], flex: object) -> Result:
    from kvrelay_kernels import build_plan, cuda_backend, reference

    dev = torch.device("cuda")
    block_size, page = 16, 128
    s = shape
    blocks_per_seq = s.context // block_size
    num_blocks = s.batch * blocks_per_seq + 1
    kv_cache = torch.randn(
        num_blocks, 1, 2, block_size, s.num_kv_heads, s.head_dim, device=dev, dtype=dtype
    )
    tables = torch.randperm(num_blocks - 1, device=dev, dtype=torch.int32) + 1
    tables = tables.view(s.batch, blocks_per_seq)
    lens = torch.full((s.batch,), s.context, dtype=torch.int32, device=dev)
    qsl = torch.arange(s.batch + 1, dtype=torch.int32, device=dev)
    query = torch.randn(s.batch, s.num_heads, s.head_dim, device=dev, dtype=dtype)
    out = torch.empty_like(query)
    scale = s.head_dim**-0.5
    plan = build_plan(tables, lens, qsl, block_size)
    result = Result(shape)
    runs: dict[str, Callable[[], object]] = {}
    if "cuda" in methods and cuda_backend.is_available():
        runs["cuda"] = lambda: cuda_backend.decode_attention(
            query, kv_cache, 0, tables, lens, s.context, scale, out=out
        )
    if "triton" in methods:
        try:
            from kvrelay_kernels import triton_attention

            runs["triton"] = lambda: triton_attention.paged_attention(
                query, kv_cache, 0, tables, lens, qsl, scale, plan=plan, out=out
            )
        except ImportError as exc:
            result.errors["triton"] = str(exc)
    if "sdpa" in methods:
        runs["sdpa"] = lambda: reference.paged_attention(
            query, kv_cache, 0, tables, lens, qsl, scale, plan=plan
        )
    if "flex" in methods and flex is not None:
        # Flex's own layout: K and V as [1, kv_heads, tokens, head_dim] (the same bytes as the
        # paged cache), 128-token pages in shuffled order (its native KV tile).
        pages = s.context // page
        total = s.batch * pages * page
        k = torch.randn(1, s.num_kv_heads, total, s.head_dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        mask = paged_block_mask(
            torch.randperm(s.batch * pages, device=dev).view(s.batch, pages), total, page
        )
        q4 = query.view(s.batch, s.num_heads, 1, s.head_dim)
        k, v = k.expand(s.batch, -1, -1, -1), v.expand(s.batch, -1, -1, -1)  # views: no copy
        runs["flex"] = lambda: flex(q4, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    for name, fn in runs.items():
        try:
            fn()  # compiles / builds outside the timing
            torch.cuda.synchronize()
            result.us[name] = median_us(fn)
        except Exception as exc:  # one failing method must not hide the others
            result.errors[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return result


def format_table(results: list[Result], copy_gbps: float, elem: int) -> str:
    head = f"{'model':<8} {'batch':>5} {'ctx':>5} " + " ".join(
        f"{m + ' us':>10} {'%bw':>5}" for m in METHODS
    )
    lines = [head, "-" * len(head)]
    for r in results:
        cells = []
        for m in METHODS:
            pct = r.percent(m, copy_gbps, elem)
            if pct is None:
                cells.append(f"{'err' if m in r.errors else '-':>10} {'':>5}")
            else:
                cells.append(f"{r.us[m]:>10.1f} {pct:>5.0f}")
        s = r.shape
        lines.append(f"{s.model:<8} {s.batch:>5} {s.context:>5} " + " ".join(cells))
    return "\n".join(lines)


def check_targets(results: list[Result], copy_gbps: float, elem: int) -> list[str]:
    """The issue's targets: CUDA >= 70% of copy bandwidth at batch >= 64 and context >= 2048,
    and faster than FlexAttention on every shape. Returns the misses."""
    misses = []
    for r in results:
        s, pct = r.shape, r.percent("cuda", copy_gbps, elem)
        tag = f"{s.model} b{s.batch} c{s.context}"
        if pct is None:
            misses.append(f"{tag}: no CUDA time")
            continue
        if s.batch >= 64 and s.context >= 2048 and pct < 70:
            misses.append(f"{tag}: CUDA at {pct:.0f}% of copy bandwidth (< 70%)")
        if "flex" in r.us and r.us["cuda"] >= r.us["flex"]:
            misses.append(f"{tag}: CUDA {r.us['cuda']:.1f} us not faster than flex")
    return misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip shapes after this")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="list the shapes and exit")
    args = parser.parse_args(argv)
    planned = shapes(args.batches, args.contexts)
    if args.dry_run:
        for s in planned:
            print(f"{s.model} batch={s.batch} context={s.context} kv_bytes={s.kv_bytes(2)}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_decode_bench: no CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    started = time.monotonic()
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    flex = None
    if "flex" in args.methods:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            # Default dynamism: after the first recompile torch marks the sizes dynamic, so
            # 24 shapes do not cost 24 compilations.
            flex = torch.compile(flex_attention)
        except Exception as exc:
            print(f"FlexAttention unavailable: {exc}", file=sys.stderr)
    results: list[Result] = []
    for s in planned:
        if time.monotonic() - started > args.budget_s:
            print(f"budget spent: skipping {s}", file=sys.stderr)
            continue
        r = bench_shape(s, dtype, args.methods, flex)
        torch.cuda.empty_cache()  # the next shape's cache may need the room (8 GiB at most)
        for m, err in r.errors.items():
            print(f"{s.model} b{s.batch} c{s.context} {m}: {err}", file=sys.stderr)
        results.append(r)
        print(format_table([r], copy_gbps, elem).splitlines()[-1], flush=True)
    results.sort(key=lambda r: (r.shape.model, r.shape.batch, r.shape.context))
    table = format_table(results, copy_gbps, elem)
    misses = check_targets(results, copy_gbps, elem)
    if args.json:
        payload = {
            "copy_gbps": copy_gbps,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "results": [asdict(r) for r in results],
            "misses": misses,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    print(f"\ndecode attention, {args.dtype}, % of {copy_gbps:.0f} GB/s copy bandwidth")
    print(table)
    print("targets: " + ("all met" if not misses else "; ".join(misses)))
    return 0 if results and not math.isnan(copy_gbps) else 1


if __name__ == "__main__":
    sys.exit(main())
