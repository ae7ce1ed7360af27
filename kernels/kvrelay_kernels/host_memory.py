"""Host memory for what a CPU decode step streams through: 2 MiB pages where Linux has them.

A decode step reads every weight once (96 MB for the default model in Q4_1, 270 MB in bf16),
far beyond the caches, and the KV blocks of every running sequence, scattered over the cache.
On 4 KiB pages that is a TLB miss every 4 KiB; on 2 MiB pages one per 2 MiB. Measured on a
2-core Zen 4 EPYC (`benchmarks/huge_pages.py`), the default model's 121 int8 matmuls of one
decode row took 4.6 ms with their weights gathered on huge pages against 5.5 ms as loaded
(5.1 against 7.6 ms on one thread).

Linux maps 2 MiB pages into a range advised with `madvise(MADV_HUGEPAGE)` when transparent
huge pages are `always` or `madvise` (the usual default), at the range's first touch, so the
advice comes before anything writes there. Where the advice cannot be given (another OS, THP
off) the memory is ordinary memory; `KVRELAY_HUGE_PAGES=0` turns the advice off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
from collections.abc import Sequence

import torch

from kvrelay_kernels.env import HUGE_PAGES

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGES_ENV = HUGE_PAGES.name
ALIGN = 64  # each gathered tensor starts on a cache line (and any dtype's boundary)


def huge_pages_wanted() -> bool:
    """Whether to advise huge pages: on Linux, unless KVRELAY_HUGE_PAGES is 0/false/off."""
    setting = HUGE_PAGES.get().strip().lower()
    return sys.platform == "linux" and setting not in ("0", "false", "off", "no")


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized `[nbytes]` uint8 CPU tensor, 2 MiB aligned and advised for huge pages
    (plain `torch.empty` below 2 MiB or without the advice). Write it before reading it."""
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_wanted():
        return torch.empty(nbytes, dtype=torch.uint8)
    span = round_up(nbytes, HUGE_PAGE_BYTES)
    raw = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)  # room to align the start
    start = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    _advise_huge_pages(raw.data_ptr() + start, span)
    return raw[start : start + nbytes]


class Arena:
    """One huge-page allocation (`huge_page_empty`) that CPU tensors are copied into, one
    after another in the order they were given, each keeping its dtype, shape and strides.

    It is the storages that are copied, whole, each once: tensors that share one (a tied
    weight, views of one buffer) keep sharing one. The arena holds no reference to the
    originals, so a caller that swaps each tensor for its copy as it goes frees them one by
    one (the peak is the arena and what is not yet placed, not twice the whole).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._offsets: dict[int, int] = {}  # storage address -> its offset in the arena
        self._copied: set[int] = set()
        total = 0
        for tensor in tensors:
            _check_gatherable(tensor)
            address = tensor.untyped_storage().data_ptr()
            if address not in self._offsets:
                self._offsets[address] = total
                total += round_up(tensor.untyped_storage().nbytes(), ALIGN)
        self.nbytes = total
        self.memory = huge_page_empty(max(total, ALIGN))

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s copy in the arena (its storage copied at its first placement); it must
        be one of the tensors the arena was made for."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        offset = self._offsets[address]
        if address not in self._copied:
            self.memory[offset : offset + storage.nbytes()].copy_(_bytes_of(storage))
            self._copied.add(address)
        return _same_view_in(self.memory, offset, tensor)


def gather(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` in one `Arena`, in the order given."""
    arena = Arena(tensors)
    return [arena.place(tensor) for tensor in tensors]


def in_one_allocation(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every one of `tensors` lives in the same allocation (as `gather` makes)."""
    return len({t.untyped_storage().data_ptr() for t in tensors}) <= 1


def _check_gatherable(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(
            f"gather takes strided CPU tensors, not a {tensor.layout} tensor on {tensor.device}"
        )


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _same_view_in(arena: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """`like`'s view (dtype, shape, strides, offset in its storage) of the storage copied to
    `arena[offset:]`."""
    element = like.element_size()
    base_bytes = arena.storage_offset() + offset  # arena's storage is bytes
    assert base_bytes % element == 0, "gathered storages start on a 64-byte boundary"
    typed = torch.empty(0, dtype=like.dtype).set_(arena.untyped_storage())
    return typed.as_strided(
        like.shape, like.stride(), base_bytes // element + like.storage_offset()
    )


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return (value + multiple - 1) // multiple * multiple


def _advise_huge_pages(address: int, length: int) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    libc = _libc()
    if advice is None or libc is None:
        return
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)):
        error = ctypes.get_errno()
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", os.strerror(error))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
