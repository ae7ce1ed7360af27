"""kvrelay_kernels.host_memory: huge-page allocations and the arena that gathers tensors."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from kvrelay_kernels.host_memory import (
    HUGE_PAGE_BYTES,
    HUGE_PAGES_ENV,
    Arena,
    gather,
    huge_page_empty,
    in_one_allocation,
)
from tests.fresh_python import run_fresh_python
from tests.kernels.huge_pages import thp_advice_works, vma_flags


@pytest.mark.skipif(not thp_advice_works(), reason="needs Linux with THP always or madvise")
def test_a_large_allocation_is_aligned_and_advised_for_huge_pages() -> None:
    buffer = huge_page_empty(3 * HUGE_PAGE_BYTES + 123)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE_BYTES + 123
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vma_flags(buffer.data_ptr())  # MADV_HUGEPAGE took
    buffer.fill_(7)  # all of it is ours to write
    assert int(buffer[-1]) == 7 and int(buffer[0]) == 7


_UNADVISED = """
import os
os.environ["KVRELAY_HUGE_PAGES"] = "0"
from kvrelay_kernels.host_memory import HUGE_PAGE_BYTES, huge_page_empty
from tests.kernels.huge_pages import vma_flags
buffer = huge_page_empty(20 * HUGE_PAGE_BYTES)
print(buffer.numel() == 20 * HUGE_PAGE_BYTES, "hg" in vma_flags(buffer.data_ptr()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_the_advice_can_be_turned_off() -> None:
    # In a fresh process: here, glibc may hand out heap memory that an earlier test's
    # allocation advised and freed, and its mapping keeps that advice.
    assert HUGE_PAGES_ENV == "KVRELAY_HUGE_PAGES"
    sized, advised = run_fresh_python(_UNADVISED, "kernels").split()
    assert sized == "True" and advised == "False"


def test_small_allocations_are_plain() -> None:
    buffer = huge_page_empty(1000)
    assert buffer.numel() == 1000 and buffer.dtype == torch.uint8


def test_gather_keeps_values_dtypes_shapes_and_strides() -> None:
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(3, 5, generator=gen)
    transposed = torch.randn(4, 6, generator=gen).to(torch.bfloat16).t()  # strided view
    codes = torch.randint(-128, 127, (17,), dtype=torch.int8, generator=gen)
    base = torch.arange(40, dtype=torch.int64)
    window = base[7:19].view(3, 4)  # an offset into its storage
    originals = [plain, transposed, codes, window]
    copies = gather(originals)
    for original, copy in zip(originals, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert copy.stride() == original.stride()
        assert torch.equal(copy, original)
        assert copy.data_ptr() != original.data_ptr()
    assert in_one_allocation(copies) and not in_one_allocation(originals)
    # In the order given, each on a cache line.
    starts = [copy.untyped_storage().data_ptr() for copy in copies]
    assert len(set(starts)) == 1
    addresses = [copy.data_ptr() - copy.storage_offset() * copy.element_size() for copy in copies]
    assert addresses == sorted(addresses)
    assert all(copy.data_ptr() % 64 == 0 for copy in copies[:3])


def test_tensors_sharing_a_storage_keep_sharing_it() -> None:
    weight = torch.randn(8, 4)
    top, bottom = weight[:4], weight[4:]
    copies = gather([weight, top, weight, bottom])
    assert copies[0].data_ptr() == copies[2].data_ptr()  # the same tensor twice: one copy
    copies[0][5, 1] = 42.0  # a write through the whole is seen by its views
    assert float(copies[3][1, 1]) == 42.0
    assert copies[1].data_ptr() == copies[0].data_ptr()
    # One copy per storage: the arena holds 8 x 4 floats, not four tensors' worth.
    arena = Arena([weight, top, weight, bottom])
    assert arena.nbytes == 8 * 4 * 4


def test_the_arena_holds_no_reference_to_the_originals() -> None:
    original = torch.randn(1024)
    arena = Arena([original])
    copy = arena.place(original)
    alive = weakref.ref(original)
    del original
    gc.collect()
    assert alive() is None  # a caller that swaps each tensor for its copy frees it
    assert copy.numel() == 1024


def test_only_strided_cpu_tensors_are_gathered() -> None:
    with pytest.raises(ValueError, match="strided CPU tensors"):
        gather([torch.empty(3, device="meta")])
    with pytest.raises(ValueError, match="strided CPU tensors"):
        gather([torch.eye(3).to_sparse()])
