"""Part 2: decode attention as a share of the device's measured copy bandwidth (bytes of K and
V read / time, over copy bandwidth): kvrelay's CUDA kernel, its Triton kernel (the decode entry
the engine's dispatch calls), gather + SDPA (the torch reference) and PyTorch FlexAttention
with a paged block mask. Beside the times, per model, the table the decode dispatch
(kvrelay_kernels/decode_dispatch.py) makes of the CUDA and Triton times, and the row for what
it serves: the faster of the two at each shape.

Shapes: batch 1/16/64/256 x context 512/2048/8192, SmolLM2-shaped (9 query / 3 KV heads x 64)
and Llama-8B-shaped (32 / 8 x 128), bf16, block size 16, shuffled block tables, a middle layer
of a 2-layer block-major cache (strided, as the engine reads it). Times are medians of
`triton.testing.do_bench` (L2 flushed between runs). Largest shapes first, so the ones the
targets are about are measured before the time budget runs out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_parts.report import FAIL, MISS, PASS, SKIP, Context, Deadline, Row

PART = "2 decode"
METHODS = ("cuda", "triton", "sdpa", "flex")
MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
NUM_LAYERS, LAYER = 2, 1
TARGET_PCT = 70.0  # of copy bandwidth, at batch >= 64 and context >= 2048
DISPATCH_TARGET_PCT = 80.0  # idem, the faster kernel the dispatch serves there (issue 37)


@dataclass(frozen=True)
class Shape:
    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int

    def kv_bytes(self, elem: int) -> int:
        """Bytes of K and V one decode step reads (one layer)."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * elem

    @property
    def tag(self) -> str:
        return f"{self.model} b{self.batch} c{self.context}"


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


def shapes(batches: list[int], contexts: list[int]) -> list[Shape]:
    """Every model x batch x context, largest first."""
    return [
        Shape(name, h, kvh, d, b, c)
        for b in sorted(batches, reverse=True)
        for c in sorted(contexts, reverse=True)
        for name, (h, kvh, d) in MODELS.items()
    ]


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


def median_us(fn: Callable[[], object], device: str) -> float:
    """Median time of `fn` in microseconds: do_bench on CUDA, wall clock on the CPU."""
    if device == "cpu":
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e3


def copy_bandwidth_gbps(device: str, nbytes: int) -> float:
    """Copy of `nbytes` on `device`: (read + written bytes) / median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def _inputs(s: Shape, dtype: torch.dtype, device: str) -> dict[str, Any]:
    block_size = 16
    blocks_per_seq = s.context // block_size
    num_blocks = s.batch * blocks_per_seq + 1
    kv_cache = torch.empty(
        num_blocks,
        NUM_LAYERS,
        2,
        block_size,
        s.num_kv_heads,
        s.head_dim,
        device=device,
        dtype=dtype,
    ).normal_()
    tables = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32) + 1
    return {
        "kv": kv_cache,
        "tables": tables.view(s.batch, blocks_per_seq),
        "lens": torch.full((s.batch,), s.context, dtype=torch.int32, device=device),
        "qsl": torch.arange(s.batch + 1, dtype=torch.int32, device=device),
        "query": torch.randn(s.batch, s.num_heads, s.head_dim, device=device, dtype=dtype),
        "scale": s.head_dim**-0.5,
    }


def _flex_run(s: Shape, dtype: torch.dtype, device: str, x: dict[str, Any], flex: Any) -> Any:
    """Flex in its own layout: K and V as [1, kv_heads, tokens, head_dim] (the same bytes as
    the paged cache), 128-token pages in shuffled order (its native KV tile)."""
    page = 128
    pages = max(1, s.context // page)
    total = s.batch * pages * page
    k = torch.randn(1, s.num_kv_heads, total, s.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = paged_block_mask(
        torch.randperm(s.batch * pages, device=device).view(s.batch, pages), total, page
    )
    q4 = x["query"].view(s.batch, s.num_heads, 1, s.head_dim)
    k, v = k.expand(s.batch, -1, -1, -1), v.expand(s.batch, -1, -1, -1)  # views: no copy
    return lambda: flex(q4, k, v, block_mask=mask, scale=x["scale"], enable_gqa=True)


def bench_shape(s: Shape, dtype: torch.dtype, device: str, methods: list[str], flex: Any) -> Result:
    from kvrelay_kernels import build_plan, cuda_backend, reference

    x = _inputs(s, dtype, device)
    out = torch.empty_like(x["query"])
    plan = build_plan(x["tables"], x["lens"], x["qsl"], 16)
    args = (x["query"], x["kv"], LAYER, x["tables"], x["lens"], x["qsl"], x["scale"])
    result = Result(s)
    runs: dict[str, Callable[[], object]] = {}
    if "cuda" in methods:
        runs["cuda"] = lambda: cuda_backend.decode_attention(
            x["query"], x["kv"], LAYER, x["tables"], x["lens"], s.context, x["scale"], out=out
        )
    if "triton" in methods:
        from kvrelay_kernels import triton_attention

        runs["triton"] = lambda: triton_attention.decode_attention(
            x["query"], x["kv"], LAYER, x["tables"], x["lens"], x["scale"], out
        )
    if "sdpa" in methods:
        runs["sdpa"] = lambda: reference.paged_attention(*args, plan=plan)
    if "flex" in methods and flex is not None:
        runs["flex"] = _flex_run(s, dtype, device, x, flex)
    for name, fn in runs.items():
        try:
            fn()  # compiles / builds outside the timing
            if device == "cuda":
                torch.cuda.synchronize()
            result.us[name] = median_us(fn, device)
        except Exception as exc:  # one failing method must not hide the others
            result.errors[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return result


def format_table(results: list[Result], copy_gbps: float, elem: int) -> str:
    """Per-shape detail: microseconds and % of copy bandwidth per method (Markdown-friendly)."""
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
        if pct is None:
            misses.append(f"{s.tag}: no CUDA time")
            continue
        if s.batch >= 64 and s.context >= 2048 and pct < TARGET_PCT:
            misses.append(f"{s.tag}: CUDA at {pct:.0f}% of copy bandwidth (< {TARGET_PCT:.0f}%)")
        if "flex" in r.us and r.us["cuda"] >= r.us["flex"]:
            misses.append(f"{s.tag}: CUDA {r.us['cuda']:.1f} us not faster than flex")
    return misses


def _methods(ctx: Context) -> tuple[list[str], Any]:
    """The methods this machine runs, and the compiled FlexAttention (None without it)."""
    if not ctx.cuda:
        return ["sdpa"], None
    from kvrelay_kernels import cuda_backend, triton_backend

    methods = ["sdpa"]
    if cuda_backend.is_available():
        methods.insert(0, "cuda")
    if triton_backend.is_available():
        methods.insert(len(methods) - 1, "triton")
    try:
        from torch.nn.attention.flex_attention import flex_attention

        # Default dynamism: after the first recompile torch marks the sizes dynamic, so 24
        # shapes do not cost 24 compilations.
        return [*methods, "flex"], torch.compile(flex_attention)
    except Exception as exc:
        ctx.log(f"FlexAttention unavailable: {exc}")
        return methods, None


def _measure(
    ctx: Context,
    deadline: Deadline,
    planned: list[Shape],
    methods: list[str],
    flex: Any,
    dtype: torch.dtype,
) -> list[Result]:
    results: list[Result] = []
    for s in planned:
        if deadline.expired():
            ctx.log(f"time budget spent: {len(planned) - len(results)} shapes not measured")
            break
        r = bench_shape(s, dtype, ctx.device, methods, flex)
        if ctx.cuda:
            torch.cuda.empty_cache()  # the next shape's cache may need the room (17 GiB at most)
        for m, err in r.errors.items():
            ctx.log(f"{s.tag} {m}: {err}")
        results.append(r)
        ctx.log(f"{s.tag}: " + ", ".join(f"{m} {us:.1f} us" for m, us in r.us.items()))
    results.sort(key=lambda r: (r.shape.model, r.shape.batch, r.shape.context))
    return results


def _target_rows(results: list[Result], copy_gbps: float, elem: int, cuda: bool) -> list[Row]:
    bw_check = f"CUDA >= {TARGET_PCT:.0f}% of copy bw at batch >= 64, ctx >= 2048"
    flex_check = "CUDA faster than FlexAttention, every shape"
    if not cuda or not any("cuda" in r.us for r in results):
        why = "no CUDA device" if not cuda else "no CUDA kernel time (see part 1)"
        return [Row(PART, bw_check, SKIP, note=why), Row(PART, flex_check, SKIP, note=why)]
    big = [
        (r.percent("cuda", copy_gbps, elem), r.shape.tag)
        for r in results
        if r.shape.batch >= 64 and r.shape.context >= 2048 and "cuda" in r.us
    ]
    rows = []
    if big:
        pct, tag = min(big)
        ok = pct is not None and pct >= TARGET_PCT
        rows.append(
            Row(
                PART,
                bw_check,
                PASS if ok else MISS,
                f"min {pct:.0f}% ({tag})",
                f">= {TARGET_PCT:.0f}%",
            )
        )
    else:
        rows.append(Row(PART, bw_check, SKIP, note="no such shape measured (time budget)"))
    both = [r for r in results if "cuda" in r.us and "flex" in r.us]
    faster = sum(r.us["cuda"] < r.us["flex"] for r in both)
    if both:
        worst = max(both, key=lambda r: r.us["cuda"] / r.us["flex"])
        note = f"worst {worst.shape.tag}: {worst.us['cuda']:.0f} vs {worst.us['flex']:.0f} us"
        status = PASS if faster == len(both) else MISS
        rows.append(Row(PART, flex_check, status, f"{faster}/{len(both)} shapes", "all", note))
    else:
        rows.append(Row(PART, flex_check, SKIP, note="FlexAttention did not run"))
    return rows


def run(ctx: Context, deadline: Deadline) -> list[Row]:
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    copy_gbps = copy_bandwidth_gbps(ctx.device, (1 << 30) if ctx.cuda else (64 << 20))
    ctx.shared["copy_gbps"] = copy_gbps
    rows = [Row(PART, "device copy bandwidth", PASS, f"{copy_gbps:.0f} GB/s")]
    methods, flex = _methods(ctx)
    planned = (
        shapes([1, 4], [64, 256]) if ctx.small else shapes([1, 16, 64, 256], [512, 2048, 8192])
    )
    results = _measure(ctx, deadline, planned, methods, flex, dtype)
    detail = format_table(results, copy_gbps, elem)
    ctx.log(f"\ndecode attention, {dtype}, % of {copy_gbps:.0f} GB/s copy bandwidth\n{detail}")
    if ctx.out_dir is not None:
        (ctx.out_dir / "decode_bench.md").write_text(f"```\n{detail}\n```\n")
    partial = "" if len(results) == len(planned) else "time budget: smallest shapes left out"
    rows += dispatch_rows(ctx, results, copy_gbps, elem, dtype)
    rows.append(
        Row(
            PART,
            "shapes measured",
            PASS if results else FAIL,
            f"{len(results)}/{len(planned)}",
            note=partial,
        )
    )
    for m in METHODS:
        if m not in methods:
            why = "no CUDA device" if not ctx.cuda else "not available here (see part 1 / log)"
            rows.append(Row(PART, f"{m} runs", SKIP, note=why))
            continue
        ok = sum(m in r.us for r in results)
        first_error = next((r.errors[m] for r in results if m in r.errors), "")
        status = PASS if ok == len(results) and results else FAIL
        rows.append(Row(PART, f"{m} runs", status, f"{ok}/{len(results)} shapes", note=first_error))
    return rows + _target_rows(results, copy_gbps, elem, ctx.cuda)


def dispatch_tables(results: list[Result], dtype: torch.dtype) -> dict[str, Any]:
    """Per model, the decode dispatch's table from these CUDA and Triton times (what an
    engine of that shape would choose at load from the same timings)."""
    from kvrelay_kernels.decode_dispatch import DecodeShape, choose_table

    tables = {}
    for name, (heads, kv_heads, dim) in MODELS.items():
        timings: dict[tuple[str, int, int], float] = {
            (kernel, r.shape.batch, r.shape.context): r.us[kernel] * 1e-6
            for r in results
            if r.shape.model == name
            for kernel in ("cuda", "triton")
            if kernel in r.us
        }
        if timings:
            shape = DecodeShape(heads, kv_heads, dim, dtype, 16, False, False)
            tables[name] = choose_table(shape, timings, {"cuda": True, "triton": True})
    return tables


def served_percent(r: Result, table: Any, copy_gbps: float, elem: int) -> float | None:
    """% of copy bandwidth of the kernel the dispatch serves shape `r` with (eager)."""
    return r.percent(table.kernel_for(r.shape.batch, r.shape.context), copy_gbps, elem)


def dispatch_rows(
    ctx: Context, results: list[Result], copy_gbps: float, elem: int, dtype: torch.dtype
) -> list[Row]:
    """The dispatch's tables (logged and written to $OUT/decode_dispatch.md) and a row: the
    kernel it serves at batch >= 64 and context >= 2048 reaches DISPATCH_TARGET_PCT there."""
    check = f"dispatched decode >= {DISPATCH_TARGET_PCT:.0f}% of copy bw, batch >= 64, ctx >= 2048"
    tables = dispatch_tables(results, dtype)
    if not tables:
        why = "no CUDA device" if not ctx.cuda else "no CUDA or Triton time"
        return [Row(PART, check, SKIP, note=why)]
    text = []
    for name, table in tables.items():
        text += [f"{name}: {table.describe()}", "(kernel, then CUDA/Triton us)", *table.grid()]
    ctx.log("\ndecode dispatch from these times\n" + "\n".join(text))
    if ctx.out_dir is not None:
        (ctx.out_dir / "decode_dispatch.md").write_text("```\n" + "\n".join(text) + "\n```\n")
    big = [
        (pct, r.shape.tag)
        for r in results
        if r.shape.batch >= 64 and r.shape.context >= 2048 and r.shape.model in tables
        for pct in [served_percent(r, tables[r.shape.model], copy_gbps, elem)]
        if pct is not None
    ]
    if not big:
        return [Row(PART, check, SKIP, note="no such shape timed for both kernels")]
    pct, tag = min(big)
    status = PASS if pct >= DISPATCH_TARGET_PCT else MISS
    target = f">= {DISPATCH_TARGET_PCT:.0f}%"
    return [Row(PART, check, status, f"min {pct:.0f}% ({tag})", target)]
