"""Backend selection: which implementation of the kernel ops the engine calls.

`auto` picks the fastest backend this machine can run: `cpu` (kvrelay's C++ decode attention,
built on first use) where it builds, else `torch`, the reference. The Triton and CUDA backends
arrive with the kernels issue and register here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kvrelay_kernels import cpu_backend, reference
from kvrelay_kernels.plan import AttentionPlan

logger = logging.getLogger(__name__)


class PagedAttentionFn(Protocol):
    def __call__(
        self,
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
    ) -> torch.Tensor: ...


class WriteKVFn(Protocol):
    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slot_mapping: torch.Tensor,
        *,
        plan: AttentionPlan | None = None,
    ) -> None: ...


class CopyBlocksFn(Protocol):
    def __call__(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of the three ops."""

    name: str
    write_kv: WriteKVFn
    paged_attention: PagedAttentionFn
    copy_blocks: CopyBlocksFn


_TORCH = AttentionBackend(
    "torch", reference.write_kv, reference.paged_attention, reference.copy_blocks
)
_CPU = AttentionBackend(
    "cpu", reference.write_kv, cpu_backend.paged_attention, reference.copy_blocks
)
_BACKENDS = {"cpu": _CPU, "torch": _TORCH}


def available_backends() -> list[str]:
    """Names of the backends this machine can run, fastest first (may build the CPU kernel)."""
    return ["cpu", "torch"] if cpu_backend.is_available() else ["torch"]


def select_backend(name: str = "auto") -> AttentionBackend:
    """The backend called `name`, or the fastest available one for `auto`.

    Raises:
        ValueError: `name` is unknown or cannot run on this machine.
    """
    choices = available_backends()
    chosen = choices[0] if name == "auto" else name
    if chosen not in choices:
        raise ValueError(
            f"attention backend {name!r} is not available here; choose one of "
            f"{', '.join(['auto', *choices])}"
        )
    logger.info("attention backend: %s (asked for %s)", chosen, name)
    return _BACKENDS[chosen]
