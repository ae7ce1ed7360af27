"""Part 1: JIT-build the CUDA extension, then every kernel against the fp32 torch reference:
fp16 / bf16, GQA groups, odd context lengths, forced split-K, and a strided multi-layer cache
laid out as the engine lays it out (block-major, all layers in one block; a middle layer is
read). On the CPU (self-test) the same cases run against kvrelay's C++ CPU kernel instead."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

from gpu_parts.report import FAIL, PASS, SKIP, Context, Deadline, Row, last_line

PART = "1 kernels"
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
NUM_LAYERS, LAYER = 3, 1  # a middle layer of a multi-layer cache: strided on both sides
SPLIT_K_MAX_LEN = 100_000  # a max_seq_len this long makes the kernel split every context


@dataclass
class Tally:
    """Cases of one kernel family: how many matched the reference, the worst error seen."""

    passed: int = 0
    total: int = 0
    worst: float = 0.0
    failures: list[str] = field(default_factory=list)
    stopped: bool = False  # the time budget ran out before every case ran

    def check(self, got: torch.Tensor, expected: torch.Tensor, dtype: Any, label: str) -> None:
        self.total += 1
        got = got.float().cpu()
        if got.isnan().any():
            self.failures.append(f"{label}: rows left unwritten (NaN)")
            return
        self.worst = max(self.worst, float((got - expected).abs().max()) if got.numel() else 0.0)
        atol, rtol = TOLERANCE[dtype]
        try:
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        except AssertionError as exc:
            self.failures.append(f"{label}: {last_line(exc)}")
            return
        self.passed += 1

    def row(self, check: str, skip_reason: str = "") -> Row:
        if self.total == 0:
            return Row(PART, check, SKIP, note=skip_reason or "no case ran (time budget)")
        value = f"{self.passed}/{self.total} cases, max|err| {self.worst:.1e}"
        note = self.failures[0] if self.failures else ""
        if self.stopped and not note:
            note = "time budget: stopped before every case ran"
        return Row(PART, check, PASS if self.passed == self.total else FAIL, value, "all", note)


def expected_output(
    batch: PagedBatch, dtype: torch.dtype, scale: float, **variant: Any
) -> torch.Tensor:
    """The reference in fp32 on the CPU, on the same dtype-rounded inputs; `variant`: the
    attention variant's keywords (sliding_window, soft_cap), none for plain attention."""
    from kvrelay_kernels import reference

    return reference.paged_attention(
        batch.query.to(dtype).float(),
        batch.kv_cache.to(dtype).float(),
        LAYER,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        **variant,
    )


def on_device(batch: PagedBatch, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    return (
        batch.query.to(device, dtype),
        batch.kv_cache.to(device, dtype),
        batch.block_tables.to(device),
        batch.seq_lens.to(device),
        batch.query_start_loc.to(device),
    )


def decode_cases(
    small: bool, dtypes: list[torch.dtype], block_sizes: tuple[int, ...]
) -> Iterator[tuple[Any, ...]]:
    """(dtype, group, head_dim, block_size, seq_lens): GQA groups of the checked models
    (SmolLM2 9/3, the 1B shape 16/8, Llama-8B 32/8) and MHA; partial last blocks; contexts of
    1,500+ tokens take the split-K path on their own."""
    shapes = [(3, 64)] if small else [(3, 64), (2, 128), (4, 128), (1, 80), (8, 256)]
    for dtype in dtypes:
        for group, head_dim in shapes:
            for block_size in (16,) if small else block_sizes:
                lens = [1, block_size + 3, 70, 3 * block_size - 1]
                if not small:
                    lens += [700, 1537]
                yield dtype, group, head_dim, block_size, lens


def build_extension(ctx: Context) -> tuple[Row, bool]:
    """JIT-build the CUDA binding (cached by torch between runs); its row and whether it built."""
    if not ctx.cuda:
        return Row(PART, "CUDA extension JIT build", SKIP, note="no CUDA device"), False
    from kvrelay_kernels import cuda_backend

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    start = time.perf_counter()
    built = cuda_backend.is_available()
    seconds = time.perf_counter() - start
    if built:
        return Row(PART, "CUDA extension JIT build", PASS, f"{seconds:.0f} s"), True
    return Row(PART, "CUDA extension JIT build", FAIL, f"{seconds:.0f} s", note=build_hint()), False


def build_hint() -> str:
    """Why torch.utils.cpp_extension could not build here, as far as can be told up front."""
    from torch.utils import cpp_extension

    missing = []
    if cpp_extension.CUDA_HOME is None:
        missing.append("no CUDA toolkit (nvcc on the PATH, or $CUDA_HOME)")
    if not cpp_extension.is_ninja_available():
        missing.append("no ninja")
    return "; ".join(missing) + " (the other backends still run)" if missing else "see the log"


AttentionCall = Callable[..., torch.Tensor]


def run_decode_cases(
    ctx: Context,
    deadline: Deadline,
    call: AttentionCall,
    dtypes: list[torch.dtype],
    split_k: bool,
    block_sizes: tuple[int, ...] = (16, 32),
) -> Tally:
    """`call(query, kv, tables, lens, qsl, max_len, scale, out)` on one-token-per-sequence
    batches, with NaN-poisoned outputs; with `split_k` also at a max_len forcing split-K."""
    tally = Tally()
    for seed, (dtype, group, head_dim, block_size, lens) in enumerate(
        decode_cases(ctx.small, dtypes, block_sizes)
    ):
        if deadline.expired():
            tally.stopped = True
            break
        batch = make_paged_batch(
            lens, [1] * len(lens), block_size, 2, group, head_dim, num_layers=NUM_LAYERS, seed=seed
        )
        query, kv, tables, seq_lens, qsl = on_device(batch, dtype, ctx.device)
        scale = head_dim**-0.5
        expected = expected_output(batch, dtype, scale)
        for max_len in (max(lens), SPLIT_K_MAX_LEN) if split_k else (max(lens),):
            out = torch.full_like(query, float("nan"))
            call(query, kv, tables, seq_lens, qsl, max_len, scale, out)
            label = f"{dtype} g{group} d{head_dim} bs{block_size} max_len {max_len} seed {seed}"
            tally.check(out, expected, dtype, label)
    return tally


def run_mixed_cases(
    ctx: Context,
    deadline: Deadline,
    call: AttentionCall,
    dtypes: list[torch.dtype],
    **variant: Any,
) -> Tally:
    """Decode and prefill rows in one step (the engine's mixed steps), through `call`;
    `variant`: sliding_window / soft_cap passed to both `call` and the reference."""
    tally = Tally()
    shapes = [(3, 64)] if ctx.small else [(3, 64), (2, 128), (4, 128)]
    for seed, (dtype, (group, head_dim)) in enumerate((d, s) for d in dtypes for s in shapes):
        if deadline.expired():
            tally.stopped = True
            break
        lens, q_lens = [40, 300, 17, 64, 1100], [1, 30, 17, 1, 300]
        if ctx.small:
            lens, q_lens = lens[:4], q_lens[:4]
        batch = make_paged_batch(
            lens, q_lens, 16, 2, group, head_dim, num_layers=NUM_LAYERS, seed=100 + seed
        )
        query, kv, tables, seq_lens, qsl = on_device(batch, dtype, ctx.device)
        out = torch.full_like(query, float("nan"))
        call(query, kv, tables, seq_lens, qsl, max(lens), 0.1, out, **variant)
        expected = expected_output(batch, dtype, 0.1, **variant)
        tally.check(out, expected, dtype, f"{dtype} g{group} seed {seed} {variant or ''}")
    return tally


def run_cache_ops(ctx: Context, dtypes: list[torch.dtype]) -> Tally:
    """write_kv (one slot padded with -1: writes nowhere) and copy_blocks, exact."""
    from kvrelay_kernels import cuda_backend, reference

    tally = Tally()
    for seed, dtype in enumerate(dtypes):
        gen = torch.Generator().manual_seed(seed)
        cache = torch.randn((8, NUM_LAYERS, 2, 16, 2, 80), generator=gen).to(dtype)
        slots = torch.randperm(8 * 16, generator=gen)[:11]
        slots[3] = -1
        kv = torch.randn(11, 4, 80, generator=gen).to(dtype)
        expected = cache.clone()
        reference.write_kv(kv[:, :2], kv[:, 2:], expected, LAYER, slots)
        src, dst = torch.tensor([0, 5, 2]), torch.tensor([7, 1, 4])
        reference.copy_blocks(expected, src, dst)
        got = cache.to(ctx.device)
        dev = ctx.device
        cuda_backend.write_kv(kv[:, :2].to(dev), kv[:, 2:].to(dev), got, LAYER, slots.to(dev))
        cuda_backend.copy_blocks(got, src.to(dev), dst.to(dev))
        tally.total += 1
        if torch.equal(got.cpu(), expected):
            tally.passed += 1
        else:
            tally.failures.append(f"{dtype}: write_kv / copy_blocks differ from the reference")
    return tally


def _cuda_decode(
    query: torch.Tensor,
    kv: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    qsl: torch.Tensor,
    max_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    from kvrelay_kernels import cuda_backend

    return cuda_backend.decode_attention(query, kv, LAYER, tables, lens, max_len, scale, out=out)


def _backend_call(name: str) -> AttentionCall:
    """A backend's `paged_attention` (what the engine calls) in the harness's signature."""
    from kvrelay_kernels import select_backend

    backend = select_backend(name)

    def call(
        query: torch.Tensor,
        kv: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        qsl: torch.Tensor,
        max_len: int,
        scale: float,
        out: torch.Tensor,
        **variant: Any,
    ) -> torch.Tensor:
        return backend.paged_attention(
            query, kv, LAYER, tables, lens, qsl, scale, out=out, **variant
        )

    return call


def run(ctx: Context, deadline: Deadline) -> list[Row]:
    from kvrelay_kernels import available_backends

    build_row, built = build_extension(ctx)
    rows = [build_row]
    backends = available_backends()
    ctx.shared["backends"] = backends
    rows.append(Row(PART, "attention backends here", PASS, " > ".join(backends)))
    if ctx.cuda:
        dtypes = [torch.float16, torch.bfloat16]
        rows += _cuda_rows(ctx, deadline, built, backends, dtypes)
    else:
        rows += _cpu_rows(ctx, deadline, backends)
    return rows


def _cuda_rows(
    ctx: Context, deadline: Deadline, built: bool, backends: list[str], dtypes: list[torch.dtype]
) -> list[Row]:
    no_build = "the CUDA extension did not build"
    rows = []
    if built:
        decode = run_decode_cases(ctx, deadline, _cuda_decode, dtypes, split_k=True)
        rows.append(decode.row("CUDA decode kernel (GQA, odd lens, split-K, strided)"))
        mixed = run_mixed_cases(ctx, deadline, _backend_call("cuda"), dtypes)
        rows.append(mixed.row("cuda backend, mixed decode + prefill step"))
        rows.append(run_cache_ops(ctx, dtypes).row("CUDA write_kv (padded slot) + copy_blocks"))
        rows.append(run_variant_cases(ctx, deadline, "cuda", dtypes))
    else:
        for check in ("CUDA decode kernel", "cuda backend, mixed step", "CUDA write_kv"):
            rows.append(Row(PART, check, SKIP, note=no_build))
    if "triton" in backends:
        triton = _backend_call("triton")
        # One block size: each shape is a Triton compilation, and the budget pays for them.
        decode = run_decode_cases(ctx, deadline, triton, dtypes, False, block_sizes=(16,))
        rows.append(decode.row("Triton, decode (GQA, odd lens, strided)"))
        rows.append(run_mixed_cases(ctx, deadline, triton, dtypes).row("Triton, mixed step"))
        rows.append(run_variant_cases(ctx, deadline, "triton", dtypes))
    else:
        rows.append(Row(PART, "Triton kernels", FAIL, note="triton is not importable"))
    return rows


# (sliding_window, soft_cap): Mistral's / Gemma's windows, Gemma 2's window with its cap, a
# cap alone, a window of one token, a window past every context (no cut).
VARIANTS = ((1, None), (7, None), (100, 50.0), (None, 5.0), (4096, None))


def run_variant_cases(
    ctx: Context, deadline: Deadline, backend: str, dtypes: list[torch.dtype]
) -> Row:
    """Mixed steps under sliding windows and soft caps (issue 40's model families)."""
    total = Tally()
    for window, cap in VARIANTS:
        tally = run_mixed_cases(
            ctx, deadline, _backend_call(backend), dtypes, sliding_window=window, soft_cap=cap
        )
        total.passed += tally.passed
        total.total += tally.total
        total.worst = max(total.worst, tally.worst)
        total.failures += tally.failures
        total.stopped = total.stopped or tally.stopped
    return total.row(f"{backend} backend, mixed step, sliding window / soft cap")


def _cpu_rows(ctx: Context, deadline: Deadline, backends: list[str]) -> list[Row]:
    """The harness on the CPU: kvrelay's C++ CPU kernel (or the reference) through it."""
    name = "cpu" if "cpu" in backends else "torch"
    call = _backend_call(name)
    dtypes = [torch.float32]
    decode = run_decode_cases(ctx, deadline, call, dtypes, split_k=False)
    mixed = run_mixed_cases(ctx, deadline, call, dtypes)
    return [
        decode.row(f"{name} backend, decode (harness self-test)"),
        mixed.row(f"{name} backend, mixed step (harness self-test)"),
        run_variant_cases(ctx, deadline, name, dtypes),
        Row(PART, "CUDA / Triton kernels", SKIP, note="no CUDA device"),
    ]
