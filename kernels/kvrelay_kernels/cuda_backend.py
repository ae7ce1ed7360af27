"""The `cuda` backend: kvrelay's CUDA C++ kernels (kernels/csrc) for decode attention,
`write_kv` and `copy_blocks`; prefill chunks go to the Triton kernel when triton is present,
else to the torch reference. A mixed step runs both kernels, each on its own rows. Decode rows
go to the Triton decode kernel instead where the decode dispatch's table, timed at load, says
it is faster (decode_dispatch.py).

The torch binding is the one built ahead of time when installed (the image's CUDA stage), else
JIT-built (torch.utils.cpp_extension, cached by torch) on the first use on a machine with
CUDA; nothing is attempted without one. CPU tensors (an engine keeping its
cache in host memory) take the torch reference.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvrelay_kernels import decode_dispatch, reference, triton_backend
from kvrelay_kernels.attention_variants import check_variants
from kvrelay_kernels.counters import COUNTERS
from kvrelay_kernels.plan import AttentionPlan, plan_on_device
from kvrelay_kernels.split import DecodeKernel, VarlenKernel, split_attention

logger = logging.getLogger(__name__)

_NAME = "kvrelay_cuda_kernels"
# Tokens per split-K partition: kPartitionSize in kernels/csrc/kvrelay_ops.h.
PARTITION_SIZE = 512
# Head sizes and dtypes with compiled decode kernels (kernels/csrc/paged_decode.cuh).
HEAD_DIMS = frozenset({64, 80, 96, 128, 256})
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# The attention variants (attention_variants.py) this backend implements: the decode kernel
# takes both (paged_decode.cuh), and so do Triton's varlen kernel and the reference, which
# serve the prefill rows.
SLIDING_WINDOW = True
SOFT_CAP = True
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def csrc_dir() -> Path:
    """Where the kernel sources are: kernels/csrc beside the package (editable install or a
    checkout), or csrc inside an installed package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "csrc"):
        if (candidate / "torch_binding.cpp").is_file():
            return candidate
    return here.parent / "csrc"


def sources() -> list[Path]:
    folder = csrc_dir()
    return [folder / "torch_binding.cpp", *sorted(folder.glob("*.cu"))]


def load_extension() -> ModuleType | None:
    """The compiled binding, built on the first call on a CUDA machine; None where it cannot."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return None
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def prebuilt() -> ModuleType | None:
    """The binding built ahead of time (the image's CUDA stage,
    deploy/docker/build_cuda_kernels.py, installs it as a module of this name), else None."""
    try:
        return importlib.import_module(_NAME)
    except ImportError:
        return None


def _build() -> ModuleType | None:
    module = prebuilt()
    if module is not None:
        return module  # an image's pods have no nvcc: never compile there
    try:
        from torch.utils.cpp_extension import load

        folder = csrc_dir()
        logger.warning("building kvrelay's CUDA kernels (first use only, about a minute)")
        return load(
            name=_NAME,
            sources=[str(s) for s in sources()],
            extra_include_paths=[str(folder)],
            extra_cflags=["-O3"],  # torch adds its own -std (C++20 for torch 2.13)
            # Target archs: torch's choice (TORCH_CUDA_ARCH_LIST, else the visible GPUs').
            extra_cuda_cflags=["-O3", "--use_fast_math"],
            verbose=False,
        )
    except Exception as exc:  # no nvcc / ninja, or a build error: other backends remain
        logger.warning("CUDA kernels unavailable (%s)", exc)
        return None


def is_available() -> bool:
    return load_extension() is not None


def decode_kernel_runs(kv_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether decode steps on `kv_cache` (queries of `num_heads` heads in its dtype) run
    the compiled CUDA decode kernel (what CUDA graphs of decode steps are captured for)."""
    if not kv_cache.is_cuda or load_extension() is None:
        return False
    query = torch.empty(1, num_heads, kv_cache.shape[5], dtype=kv_cache.dtype, device="meta")
    return _decode_supported(query, kv_cache)


def _decode_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the compiled decode kernel takes these tensors (16-byte aligned K/V rows)."""
    block_size = kv_cache.shape[3]
    vec = 16 // kv_cache.element_size()
    return (
        kv_cache.is_cuda
        and kv_cache.dtype in DTYPES
        and query.dtype == kv_cache.dtype
        and query.shape[2] in HEAD_DIMS
        and block_size & (block_size - 1) == 0
        and kv_cache.stride(5) == 1
        and kv_cache.data_ptr() % 16 == 0
        and all(stride % vec == 0 for stride in kv_cache.stride()[:5])
    )


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_partitions: int = 0,
    workspace: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention by the CUDA kernel: `query` `[num_seqs, num_heads, head_dim]`, one
    token per sequence, `seq_lens` its context (own token included), `max_seq_len` their
    maximum (a host value, so no device sync), `out` contiguous when given.

    `num_partitions` > 0 fixes the split-K count (CUDA graphs: the launch shape must not
    change between replays), and `workspace` (fp32, `split_workspace_numel` elements) is
    the split-K scratch reused instead of allocated per call; 0 lets the kernel decide.
    `sliding_window` and `soft_cap`: attention_variants.py (the kernel reads the window only).
    """
    module = load_extension()
    assert module is not None, "decode_attention needs the CUDA kernels (is_available())"
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    tables = block_tables.to(device=query.device, dtype=torch.int32)
    lens = seq_lens.to(device=query.device, dtype=torch.int32).contiguous()
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    COUNTERS.cuda_decode_calls += 1
    args = (out, query, kv_cache, layer, tables, lens, max_seq_len, scale, num_partitions)
    if sliding_window is None and soft_cap is None:  # the plain call, as it always was
        module.paged_decode_attention(*args, workspace)
    else:  # the kernel's "none" is 0
        module.paged_decode_attention(*args, workspace, sliding_window or 0, soft_cap or 0.0)
    return out


def split_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, partitions: int) -> int:
    """fp32 elements of the split-K scratch: partial outputs, maxima and sums per partition."""
    return num_seqs * num_heads * partitions * (head_dim + 2)


def max_partitions(max_seq_len: int) -> int:
    """The split-K count that covers any context up to `max_seq_len` (the kernel uses this
    many, or 1: one partition covers any length)."""
    return max(1, -(-max_seq_len // PARTITION_SIZE))


def graph_partitions(
    max_seq_len: int, num_seqs: int, num_kv_heads: int, group: int, device: torch.device
) -> int:
    """The fixed split-K count for a CUDA graph of `num_seqs` decodes whose contexts may reach
    `max_seq_len`: the kernel's own choice for that worst case (1 or `max_partitions`)."""
    module = load_extension()
    assert module is not None, "graph_partitions needs the CUDA kernels"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    parts = int(module.decode_num_partitions(max_seq_len, num_seqs, num_kv_heads, group, sms))
    assert parts in (1, max_partitions(max_seq_len)), parts
    return parts


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
    """Same meaning as `reference.paged_attention`. Decode rows go to the CUDA decode kernel
    and prefill rows to the Triton varlen kernel, in one step (split.py); shapes without a
    compiled decode kernel send the whole batch to Triton (else the torch reference). The
    sliding window and soft cap reach every kernel."""
    check_variants(sliding_window, soft_cap)
    variant = _variant_kwargs(sliding_window, soft_cap)
    if not kv_cache.is_cuda:
        return reference.paged_attention(
            query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale,
            plan=plan, out=out, **variant,
        )  # fmt: skip
    if plan is None:  # a direct caller: the plan's indices must live where the query does
        plan, block_tables, seq_lens, query_start_loc = plan_on_device(
            query.device, block_tables, seq_lens, query_start_loc, kv_cache.shape[3]
        )
    args = (query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale)
    if not (plan.has_decodes and _decode_supported(query, kv_cache) and load_extension()):
        return _without_decode_kernel(args, plan, out, variant)
    decode = _decode_kernel(query.shape[1], kv_cache, layer, plan, scale, variant)
    if out is not None and not out.is_contiguous():
        # The decode kernel writes contiguous rows; a strided `out` gets the result copied.
        return out.copy_(paged_attention(*args, plan=plan, **variant))
    if not plan.prefills or not triton_backend.is_available():
        result = split_attention(
            query, block_tables, seq_lens, query_start_loc, replace(plan, prefills=()), out,
            decode, _no_prefill,
        )  # fmt: skip
        if plan.prefills:  # no Triton here: the reference computes the prefill rows
            reference.prefill_attention(
                query, kv_cache, layer, plan, scale, result, sliding_window, soft_cap
            )
        return result

    prefill = _triton_prefill(kv_cache, layer, scale, variant)
    return split_attention(
        query, block_tables, seq_lens, query_start_loc, plan, out, decode, prefill
    )


def _decode_kernel(
    num_heads: int,
    kv_cache: torch.Tensor,
    layer: int,
    plan: AttentionPlan,
    scale: float,
    variant: dict[str, Any],
) -> DecodeKernel:
    """The step's decode rows' kernel, as the decode dispatch's table says
    (decode_dispatch.py): a plan with a fixed split-K count is a CUDA graph's."""
    assert plan.decode_block_tables is not None
    kernel = decode_dispatch.kernel_for_step(
        num_heads, kv_cache, plan.decode_block_tables.shape[0], plan.decode_context,
        plan.decode_partitions > 0, "sliding_window" in variant, "soft_cap" in variant,
    )  # fmt: skip
    if kernel == decode_dispatch.TRITON:
        from kvrelay_kernels import triton_attention

        def triton_decode(
            q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, into: torch.Tensor | None
        ) -> torch.Tensor:
            COUNTERS.triton_decode_calls += 1
            return triton_attention.decode_attention(
                q, kv_cache, layer, tables, lens, scale, into, **variant
            )

        return triton_decode

    def decode(
        q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, into: torch.Tensor | None
    ) -> torch.Tensor:
        return decode_attention(
            q, kv_cache, layer, tables, lens, plan.decode_context, scale, out=into,
            num_partitions=plan.decode_partitions, workspace=plan.decode_workspace, **variant,
        )  # fmt: skip

    return decode


def _variant_kwargs(sliding_window: int | None, soft_cap: float | None) -> dict[str, Any]:
    """The variants' keyword arguments, only those that are set (a plain call keeps its
    arguments as they were)."""
    named = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    return {name: value for name, value in named.items() if value is not None}


def _triton_prefill(
    kv_cache: torch.Tensor, layer: int, scale: float, variant: dict[str, Any]
) -> VarlenKernel:
    """The Triton varlen kernel over a split step's prefill rows (split.py's VarlenKernel)."""

    def prefill(
        q: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        qsl: torch.Tensor,
        into: torch.Tensor | None,
    ) -> torch.Tensor:
        COUNTERS.triton_prefill_calls += 1
        return triton_backend.paged_attention(
            q, kv_cache, layer, tables, lens, qsl, scale, out=into, **variant
        )

    return prefill


def _without_decode_kernel(
    args: tuple[Any, ...], plan: AttentionPlan, out: torch.Tensor | None, variant: dict[str, Any]
) -> torch.Tensor:
    """The whole batch on Triton (else the torch reference): no compiled decode kernel fits."""
    if triton_backend.is_available():
        COUNTERS.triton_prefill_calls += bool(plan.prefills)
        return triton_backend.paged_attention(*args, plan=plan, out=out, **variant)
    return reference.paged_attention(*args, plan=plan, out=out, **variant)


def _no_prefill(*_: object) -> torch.Tensor:
    raise AssertionError("a decode-only plan has no prefill rows")


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
    module = load_extension() if kv_cache.is_cuda else None
    if module is None or kv_cache.dtype not in DTYPES or kv_cache.stride(5) != 1:
        reference.write_kv(key, value, kv_cache, layer, slot_mapping, plan=plan)
        return
    key = key.to(kv_cache.dtype)
    value = value.to(kv_cache.dtype)
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    module.write_kv(key, value, kv_cache, layer, slots)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Same meaning as `reference.copy_blocks`."""
    module = load_extension() if kv_cache.is_cuda else None
    block_bytes = kv_cache[0].numel() * kv_cache.element_size() if kv_cache.numel() else 0
    if module is None or not kv_cache[0].is_contiguous() or block_bytes % 16:
        reference.copy_blocks(kv_cache, src, dst)
        return
    if src.numel():
        device = kv_cache.device
        module.copy_blocks(
            kv_cache,
            src.to(device=device, dtype=torch.int64).contiguous(),
            dst.to(device=device, dtype=torch.int64).contiguous(),
        )
