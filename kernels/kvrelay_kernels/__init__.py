"""kvrelay's kernel ops: paged attention, KV write and block copy, with a torch reference.

Backends are chosen by `select_backend`; the torch reference defines every op's meaning.
"""

from __future__ import annotations

from kvrelay_kernels.backend import AttentionBackend, available_backends, select_backend
from kvrelay_kernels.plan import AttentionPlan, PrefillChunk, build_plan
from kvrelay_kernels.reference import copy_blocks, paged_attention, write_kv

__all__ = [
    "AttentionBackend",
    "AttentionPlan",
    "PrefillChunk",
    "available_backends",
    "build_plan",
    "copy_blocks",
    "paged_attention",
    "select_backend",
    "write_kv",
]
