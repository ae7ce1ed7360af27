"""Stand-ins for the compiled CUDA kernels (kernels/csrc/torch_binding.cpp), the Triton
attention kernel and the fused layer ops (gpu_fused.py): they check what the binding checks,
plus what the binding cannot check but a kernel would crash on (every tensor on the device: a
host pointer handed to a kernel is an illegal address), and log each call. They compute
nothing: the tensors are fake."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvrelay_kernels import cuda_backend, gpu_fused

# kernels/csrc/kvrelay_ops.h
_MAX_GROUP_PER_CTA = 8
_PARTITION_SIZE = 512
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class KernelLog:
    """Each launch: (kernel, rows) — rows are sequences for decode, tokens for the others."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    # Each decode launch: (split-K partitions, whether it was given the shared workspace).
    decode_splits: list[tuple[int, bool]] = field(default_factory=list)

    def count(self, kernel: str) -> int:
        return sum(1 for name, _ in self.calls if name == kernel)


LOG = KernelLog()


def _on_device(**tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device.type != "cuda":
            raise RuntimeError(f"{name} is on {tensor.device}: a kernel reading a host pointer")


def _check_cache(kv_cache: torch.Tensor, layer: int) -> None:
    if kv_cache.dim() != 6 or kv_cache.stride(5) != 1:
        raise RuntimeError("kv_cache must be [blocks, layers, 2, block_size, heads, dim]")
    if kv_cache.dtype not in _DTYPES:
        raise RuntimeError(f"kvrelay CUDA kernels do not support {kv_cache.dtype}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise RuntimeError("layer out of range")


class FakeCudaKernels:
    """The `kvrelay_cuda_kernels` module's functions."""

    @staticmethod
    def paged_decode_attention(
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        scale: float,
        num_partitions: int,
        workspace: torch.Tensor | None,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
    ) -> None:
        _on_device(out=out, query=query, kv_cache=kv_cache, block_tables=block_tables,
                   seq_lens=seq_lens, workspace=workspace)  # fmt: skip
        _check_cache(kv_cache, layer)
        seqs, heads, head_dim = query.shape
        if query.stride(2) != 1 or not out.is_contiguous() or out.shape != query.shape:
            raise RuntimeError("query must be [seqs, heads, dim] and out match it")
        if not query.dtype == out.dtype == kv_cache.dtype:
            raise RuntimeError("query, out and kv_cache must share a dtype")
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise RuntimeError("block_tables and seq_lens must be int32")
        if block_tables.stride(1) != 1 or not seq_lens.is_contiguous():
            raise RuntimeError("tables: rows contiguous")
        if block_tables.shape[0] < seqs or seq_lens.shape != (seqs,):
            raise RuntimeError("one block-table row and one length per sequence")
        if kv_cache.shape[5] != head_dim or heads % kv_cache.shape[4]:
            raise RuntimeError("head shapes disagree")
        if head_dim not in cuda_backend.HEAD_DIMS:
            raise RuntimeError(f"unsupported head_dim {head_dim}")
        if not isinstance(max_seq_len, int):
            raise TypeError("max_seq_len must be a host int (no device read)")
        if sliding_window < 0 or not 0 <= soft_cap < float("inf"):
            raise RuntimeError("sliding_window (0: none) and soft_cap (0: none) must be >= 0")
        if sliding_window > 0:  # the binding's split-K covers the window only
            max_seq_len = min(max_seq_len, sliding_window)
        parts = num_partitions or FakeCudaKernels.decode_num_partitions(
            max_seq_len, seqs, kv_cache.shape[4], heads // kv_cache.shape[4], 132
        )
        if parts > 1 and parts * _PARTITION_SIZE < max_seq_len:
            raise RuntimeError(f"num_partitions {parts} cannot cover a context of {max_seq_len}")
        if parts > 1 and workspace is not None:
            if workspace.dtype != torch.float32 or not workspace.is_contiguous():
                raise RuntimeError("workspace must be contiguous fp32")
            if workspace.numel() < seqs * heads * parts * (head_dim + 2):
                raise RuntimeError("workspace too small")
        LOG.calls.append(("decode", seqs))
        LOG.decode_splits.append((parts, workspace is not None))

    @staticmethod
    def write_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slot_mapping: torch.Tensor,
    ) -> None:
        _on_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
        _check_cache(kv_cache, layer)
        if not key.dtype == value.dtype == kv_cache.dtype:
            raise RuntimeError("key, value and kv_cache must share a dtype")
        if key.dim() != 3 or key.stride(2) != 1 or value.stride(2) != 1:
            raise RuntimeError("key and value must be [tokens, kv_heads, dim]")
        if key.shape != value.shape or key.shape[1:] != kv_cache.shape[4:]:
            raise RuntimeError("key / value shapes disagree with the cache")
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            raise RuntimeError("slot_mapping must be contiguous int64")
        if slot_mapping.shape[0] != key.shape[0]:
            raise RuntimeError("one slot per token")
        LOG.calls.append(("write_kv", key.shape[0]))

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        _on_device(kv_cache=kv_cache, src=src, dst=dst)
        if src.dtype != torch.int64 or dst.dtype != torch.int64 or src.shape != dst.shape:
            raise RuntimeError("src and dst must be contiguous int64 of one length")
        if not kv_cache[0].is_contiguous():
            raise RuntimeError("copy_blocks needs each block contiguous")
        LOG.calls.append(("copy_blocks", src.shape[0]))

    @staticmethod
    def decode_num_partitions(
        max_seq_len: int, num_seqs: int, num_kv_heads: int, group: int, num_sms: int
    ) -> int:
        parts = -(-max_seq_len // _PARTITION_SIZE)
        if parts <= 1:
            return 1
        ctas = num_seqs * num_kv_heads * -(-group // _MAX_GROUP_PER_CTA)
        return parts if ctas < 2 * num_sms or max_seq_len > 8192 else 1


def fake_triton_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    plan: Any = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`triton_attention.paged_attention`: the varlen kernel over prefill (and decode) rows."""
    _on_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
               query_start_loc=query_start_loc, out=out)  # fmt: skip
    _check_cache(kv_cache, layer)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise RuntimeError("one query start per sequence, plus the end")
    LOG.calls.append(("triton", query.shape[0]))
    return out if out is not None else torch.empty_like(query)


def fake_triton_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`triton_attention.decode_attention`: the Triton kernel over decode rows only (where the
    decode dispatch chose it over the CUDA kernel)."""
    _on_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
               out=out)  # fmt: skip
    _check_cache(kv_cache, layer)
    seqs = query.shape[0]
    if query.dim() != 3 or seq_lens.shape != (seqs,) or block_tables.shape[0] < seqs:
        raise RuntimeError("query [seqs, heads, dim], one length and one table row per sequence")
    if out is not None and out.shape != query.shape:
        raise RuntimeError("out must match the query")
    LOG.calls.append(("triton_decode", seqs))
    return out if out is not None else torch.empty_like(query)


class FakeGpuFusedOps:
    """`gpu_fused`'s Triton ops: checks of what their wrappers and kernels need, a log line
    each, and outputs of the right shape."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _on_device(x=x, weight=weight)
        if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
            raise RuntimeError("rms_norm: x [T, hidden] rows contiguous, weight [hidden]")
        LOG.calls.append(("rms_norm", x.shape[0]))
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def add_rms_norm(
        residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        _on_device(residual=residual, delta=delta, weight=weight)
        if residual.shape != delta.shape or residual.dtype != delta.dtype:
            raise RuntimeError("add_rms_norm: residual and delta must match")
        LOG.calls.append(("add_rms_norm", residual.shape[0]))
        return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        _on_device(gate_up=gate_up)
        rows, width = gate_up.shape
        if width % 2 or gate_up.stride(1) != 1:
            raise RuntimeError("silu_and_mul: [T, 2 * intermediate], rows contiguous")
        LOG.calls.append(("silu_and_mul", rows))
        return torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)

    @staticmethod
    def rope_and_write_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        _on_device(qkv=qkv, cos=cos, sin=sin, kv_cache=kv_cache, slot_mapping=slot_mapping)
        _check_cache(kv_cache, layer)
        tokens = qkv.shape[0]
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise RuntimeError("rope_and_write_kv: qkv is [T, (h + 2 kvh) d]")
        if cos.shape != (tokens, 1, head_dim // 2) or sin.shape != cos.shape:
            raise RuntimeError("rope_and_write_kv: cos and sin are [T, 1, d / 2]")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (tokens,):
            raise RuntimeError("rope_and_write_kv: one int64 slot per token")
        if kv_cache.shape[4:] != (num_kv_heads, head_dim):
            raise RuntimeError("rope_and_write_kv: the cache's heads disagree")
        LOG.calls.append(("rope_and_write_kv", tokens))
        return torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)


def fake_sample_rows(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """`triton_sampling.sample_rows`: one launch over the non-greedy rows."""
    _on_device(x=x, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
               uniforms=uniforms)  # fmt: skip
    rows = x.shape[0]
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise RuntimeError("sample_rows: x is fp32 [R, V], rows contiguous")
    for name, t in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                    ("uniforms", uniforms), ("top_k", top_k)):  # fmt: skip
        want = (torch.int32, torch.int64) if name == "top_k" else (torch.float32,)
        if t.shape != (rows,) or t.dtype not in want or t.stride(0) != 1:
            raise RuntimeError(f"sample_rows: {name} must be a contiguous [{rows}] of {want}")
    LOG.calls.append(("sample_rows", rows))
    return torch.empty(rows, dtype=torch.int64, device=x.device)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route cuda_backend's compiled module and the Triton kernel to the stand-ins. (Triton is
    imported here, not above: a pytest session that imports it before tests/kernels/
    triton_interp sets TRITON_INTERPRET would skip those tests.)"""
    from kvrelay_kernels import triton_attention

    monkeypatch.setitem(cuda_backend._state, "module", FakeCudaKernels)
    monkeypatch.setitem(gpu_fused._state, "ops", FakeGpuFusedOps)
    monkeypatch.setattr(triton_attention, "paged_attention", fake_triton_attention)
    monkeypatch.setattr(triton_attention, "decode_attention", fake_triton_decode)
    from kvrelay.engine import sampler

    monkeypatch.setitem(sampler._device_state, "sample_rows", fake_sample_rows)
