"""The `triton` backend: varlen paged attention and `write_kv` by Triton kernels, block copy
by torch. Triton is imported only when the backend is used, never by `kvrelay_kernels` itself.

On CPU tensors the kernels run only under TRITON_INTERPRET=1 (tests); without it, CPU
tensors (an engine that keeps its cache on the CPU) take the torch reference.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from kvrelay_kernels import reference
from kvrelay_kernels.attention_variants import check_variants
from kvrelay_kernels.plan import AttentionPlan

# The attention variants (attention_variants.py) this backend implements.
SLIDING_WINDOW = True
SOFT_CAP = True


def interpreting() -> bool:
    """Whether triton was asked to interpret kernels on the CPU (read once triton loads)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_available() -> bool:
    """Triton is installed, and there is a GPU or the interpreter to run its kernels."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpreting()


def _runs_here(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or interpreting()


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
    """Same meaning as `reference.paged_attention` (sliding window and soft cap included)."""
    check_variants(sliding_window, soft_cap)
    # Passed on only when set: a plain call keeps its arguments as they were.
    variant = _variant_kwargs(sliding_window, soft_cap)
    if not _runs_here(kv_cache):
        return reference.paged_attention(
            query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale,
            plan=plan, out=out, **variant,
        )  # fmt: skip
    from kvrelay_kernels import triton_attention

    return triton_attention.paged_attention(
        query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale,
        plan=plan, out=out, **variant,
    )  # fmt: skip


def _variant_kwargs(sliding_window: int | None, soft_cap: float | None) -> dict[str, Any]:
    """The variants' keyword arguments, only those that are set."""
    named = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    return {name: value for name, value in named.items() if value is not None}


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    plan: AttentionPlan | None = None,
) -> None:
    """Same meaning as `reference.write_kv`."""
    if not _runs_here(kv_cache):
        reference.write_kv(key, value, kv_cache, layer, slot_mapping, plan=plan)
        return
    from kvrelay_kernels import triton_write_kv

    triton_write_kv.write_kv(key, value, kv_cache, layer, slot_mapping, plan=plan)
