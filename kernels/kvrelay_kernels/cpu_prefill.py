"""Prefill attention on the CPU by kvrelay's C++ kernel (csrc_cpu/paged_prefill_attention.cpp):
the causal attention of a step's multi-token chunks, read from the paged cache where it lies.

The torch reference gathers each chunk's keys and values and calls SDPA; for a 128-token bf16
prompt of the default 135M model that took ~0.4 ms a layer on a 2-core EPYC, ~13% of the
prefill (benchmarks/cpu_attention.py --prefill prints both). Where the kernel cannot run (no
compiler, another dtype) the reference does, with the same meaning: sliding window and soft cap
included.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvrelay_kernels import reference
from kvrelay_kernels.cpu_extension import load_cpu_extension
from kvrelay_kernels.plan import AttentionPlan, PrefillChunk

_DTYPES = (torch.float32, torch.bfloat16)  # the query's and the cache's alike
# fast-math: GCC vectorizes the exps with glibc's libmvec; the kernel keeps no infinities.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def load_extension() -> ModuleType | None:
    """The compiled kernel, built on the first call; None where it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_prefill_attention",
        "paged_prefill_attention.cpp",
        _FLAGS,
        "CPU prefill attention kernel",
    )


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Same meaning as `reference.prefill_attention`: the plan's multi-token chunks' causal
    attention written into their rows of `out` (`query`'s shape; other rows untouched)."""
    if not plan.prefills:
        return
    module = load_extension()
    if module is None or not _kernel_takes(query, kv_cache, out):
        reference.prefill_attention(
            query, kv_cache, layer, plan, scale, out, sliding_window, soft_cap
        )
        return
    chunks, tables = _chunk_arrays(plan.prefills)
    module.paged_prefill_attention(
        _rows_of_heads(query),
        kv_cache,
        layer,
        chunks,
        tables,
        scale,
        sliding_window or 0,
        soft_cap or 0.0,
        out,
    )


def _kernel_takes(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel runs these tensors: CPU, one dtype it knows, an `out` whose rows
    hold their heads one after another (it writes in place), a block-major cache."""
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and kv_cache.dtype == query.dtype == out.dtype
        and kv_cache.is_contiguous()
        and out.stride(2) == 1
        and out.stride(1) == out.size(2)
    )


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, heads, dim] with each row's heads contiguous (rows may be strided: no copy for
    queries viewed in a fused QKV projection's output)."""
    if x.stride(2) == 1 and x.stride(1) == x.size(2):
        return x
    return x.contiguous()


def _chunk_arrays(chunks: tuple[PrefillChunk, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's [C, 3] (first row, rows, context) and [C, max_blocks] block tables."""
    spec = torch.tensor(
        [(c.q_start, c.q_end - c.q_start, c.context_len) for c in chunks], dtype=torch.int64
    )
    if len(chunks) == 1:
        return spec, chunks[0].block_ids.view(1, -1)
    widest = max(c.block_ids.numel() for c in chunks)
    tables = torch.zeros(len(chunks), widest, dtype=torch.int64)
    for i, c in enumerate(chunks):
        tables[i, : c.block_ids.numel()] = c.block_ids
    return spec, tables
