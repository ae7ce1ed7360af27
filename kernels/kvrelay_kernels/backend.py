"""Backend selection: which implementation of the kernel ops the engine calls.

`auto` picks the fastest backend this machine can run. With CUDA: `cuda` (kvrelay's CUDA C++
kernels, JIT-built on first use), then `triton`, then `torch`. Without: `cpu` (kvrelay's C++
decode attention, built on first use) where it builds, then `torch`, the reference; `triton`
is offered last there, and only under TRITON_INTERPRET=1 (slow: tests ask for it by name).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kvrelay_kernels import cpu_backend, cuda_backend, reference, triton_backend
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
        sliding_window: int | None = None,
        soft_cap: float | None = None,
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
    """One implementation of the three ops, and which per-call attention variants
    (attention_variants.py) its `paged_attention` implements: the engine checks a model's
    needs against these at load time; a call asking for a missing one raises ValueError."""

    name: str
    write_kv: WriteKVFn
    paged_attention: PagedAttentionFn
    copy_blocks: CopyBlocksFn
    sliding_window: bool
    soft_cap: bool

    def check_supports(self, sliding_window: bool, soft_cap: bool) -> None:
        """Raise ValueError, naming this backend and the `torch` one, when a model needs a
        variant (`sliding_window`: some layer has a window; `soft_cap`: some layer caps its
        scores) that this backend does not implement."""
        missing = [
            feature
            for feature, needed, supported in (
                ("sliding-window attention", sliding_window, self.sliding_window),
                ("attention-logit soft-capping", soft_cap, self.soft_cap),
            )
            if needed and not supported
        ]
        if missing:
            raise ValueError(
                f"the {self.name!r} attention backend does not implement "
                f"{' or '.join(missing)}, which this model needs; choose the 'torch' backend"
            )


_TORCH = AttentionBackend(
    "torch", reference.write_kv, reference.paged_attention, reference.copy_blocks,
    sliding_window=True, soft_cap=True,
)  # fmt: skip
_CPU = AttentionBackend(
    "cpu", cpu_backend.write_kv, cpu_backend.paged_attention, reference.copy_blocks,
    sliding_window=cpu_backend.SLIDING_WINDOW, soft_cap=cpu_backend.SOFT_CAP,
)  # fmt: skip
_TRITON = AttentionBackend(
    "triton", triton_backend.write_kv, triton_backend.paged_attention, reference.copy_blocks,
    sliding_window=triton_backend.SLIDING_WINDOW, soft_cap=triton_backend.SOFT_CAP,
)  # fmt: skip
_CUDA = AttentionBackend(
    "cuda", cuda_backend.write_kv, cuda_backend.paged_attention, cuda_backend.copy_blocks,
    sliding_window=cuda_backend.SLIDING_WINDOW, soft_cap=cuda_backend.SOFT_CAP,
)  # fmt: skip
_BACKENDS = {"cuda": _CUDA, "triton": _TRITON, "cpu": _CPU, "torch": _TORCH}


def available_backends() -> list[str]:
    """Names of the backends this machine can run, fastest first (may build the C++ or CUDA
    kernels, once per process)."""
    if torch.cuda.is_available():
        names = ["cuda"] if cuda_backend.is_available() else []
        if triton_backend.is_available():
            names.append("triton")
        return [*names, "torch"]
    names = ["cpu", "torch"] if cpu_backend.is_available() else ["torch"]
    if triton_backend.is_available():  # interpreted on the CPU: correct, slow, by name only
        names.append("triton")
    return names


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
