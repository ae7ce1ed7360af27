"""The `cpu` backend: KV writes, decode attention and prefill attention (cpu_prefill.py) by
kvrelay's C++ kernels, block copies by the torch reference. The kernels are built once on
first use (torch cpp_extension, cached by torch); `is_available` builds both.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from kvrelay_kernels import cpu_prefill, reference
from kvrelay_kernels.attention_variants import check_variants
from kvrelay_kernels.cpu_extension import load_cpu_extension
from kvrelay_kernels.plan import AttentionPlan, build_plan

# The attention variants (attention_variants.py) this backend implements.
SLIDING_WINDOW = True
SOFT_CAP = True
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the query's and the cache's alike
# fast-math lets GCC vectorize the exps (glibc's libmvec) and the dot reductions; the kernel
# avoids infinities, so dropping their guarantees is safe.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def load_extension() -> ModuleType | None:
    """The compiled kernel, built on the first call; None where it cannot be built."""
    return load_cpu_extension(
        "kvrelay_cpu_attention", "paged_decode_attention.cpp", _FLAGS, "CPU attention kernel"
    )


def is_available() -> bool:
    """Whether the decode kernel builds here; builds the prefill kernel too, so that a
    server's first prompt does not wait for a compile (it falls back to the reference)."""
    cpu_prefill.load_extension()
    return load_extension() is not None


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    plan: AttentionPlan | None = None,
) -> None:
    """Same meaning as `reference.write_kv`: one copy per token in C++ (padding slots skipped
    there) where the tensors qualify, the reference otherwise."""
    module = load_extension()
    takes = (
        module is not None
        and kv_cache.is_cpu
        and key.dtype == value.dtype == kv_cache.dtype
        and slot_mapping.dtype == torch.int64
    )
    if not takes:
        reference.write_kv(key, value, kv_cache, layer, slot_mapping, plan=plan)
        return
    assert module is not None
    module.write_kv(_heads_contiguous(key), _heads_contiguous(value), kv_cache, layer, slot_mapping)


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, heads, dim] as the kernel reads it: each token's heads one after another (rows
    may be strided, e.g. keys viewed in a fused QKV projection's output; no copy then)."""
    if x.stride(2) == 1 and x.stride(1) == x.size(2):
        return x
    return x.contiguous()


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Same meaning as `reference.paged_attention` (sliding window and soft cap included);
    decode rows and prefill chunks each go through their C++ kernel."""
    check_variants(sliding_window, soft_cap)
    module = load_extension()
    if plan is None:
        plan = build_plan(block_tables, seq_lens, query_start_loc, kv_cache.shape[3])
    kernel_takes = query.dtype in _KERNEL_DTYPES and kv_cache.dtype == query.dtype
    if kernel_takes and not plan.has_decodes:  # a step of prompts only
        out = torch.empty_like(query) if out is None else out
        cpu_prefill.prefill_attention(
            query, kv_cache, layer, plan, scale, out, sliding_window, soft_cap
        )
        return out
    if module is None or not kernel_takes:
        return reference.paged_attention(
            query,
            kv_cache,
            layer,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            plan=plan,
            out=out,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    assert plan.decode_block_tables is not None and plan.decode_lens is not None
    rows = plan.decode_token_idx
    decode_q = query if rows is None else query[rows]

    args = (kv_cache, layer, plan.decode_block_tables, plan.decode_lens, scale)
    variant = _kernel_variant(sliding_window, soft_cap)

    def decode(q: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = module.paged_decode_attention(q.contiguous(), *args, *variant)
        return result

    if rows is None and out is None:
        return decode(decode_q)  # an all-decode step
    out = reference.place_decode_rows(query, rows, decode(decode_q), out)
    cpu_prefill.prefill_attention(
        query, kv_cache, layer, plan, scale, out, sliding_window, soft_cap
    )
    return out


def _kernel_variant(sliding_window: int | None, soft_cap: float | None) -> tuple[Any, ...]:
    """The decode kernel's trailing arguments: none for plain attention (the call stays as it
    was), else the window and cap with 0 for "none"."""
    if sliding_window is None and soft_cap is None:
        return ()
    return (sliding_window or 0, soft_cap or 0.0)
