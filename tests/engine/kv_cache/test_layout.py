"""engine.kv_cache.layout: the worker's one block-major KV tensor."""

from __future__ import annotations

import sys

import pytest
import torch

from kvrelay.engine.kv_cache.layout import allocate_kv_cache, kv_block_bytes
from kvrelay_kernels.host_memory import HUGE_PAGE_BYTES, HUGE_PAGES_ENV
from tests.engine.conftest import load_model_config_135m
from tests.fresh_python import run_fresh_python
from tests.kernels.huge_pages import thp_advice_works, vma_flags

CONFIG = load_model_config_135m()  # 30 layers, 3 KV heads of 64 dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_is_zeroed_block_major_and_contiguous(dtype: torch.dtype) -> None:
    cache = allocate_kv_cache(CONFIG, num_blocks=12, block_size=16, dtype=dtype)
    assert cache.shape == (12, 30, 2, 16, 3, 64) and cache.dtype == dtype
    assert cache.is_contiguous() and not cache.any()
    assert cache.numel() * cache.element_size() == 12 * kv_block_bytes(CONFIG, 16, dtype)
    cache[11, 29, 1, 15, 2, 63] = 1.0  # the last element is the cache's own
    assert float(cache.flatten()[-1]) == 1.0


@pytest.mark.skipif(not thp_advice_works(), reason="needs Linux with THP always or madvise")
def test_a_cpu_cache_lies_on_huge_pages() -> None:
    cache = allocate_kv_cache(CONFIG, num_blocks=16, block_size=16, dtype=torch.bfloat16)
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vma_flags(cache.data_ptr())


_PLAIN_CACHE = """
import os
os.environ["KVRELAY_HUGE_PAGES"] = "off"
import torch
from kvrelay.engine.kv_cache.layout import allocate_kv_cache
from tests.engine.conftest import load_model_config_135m
from tests.kernels.huge_pages import vma_flags
# 100 blocks, 37 MB: above glibc's largest mmap threshold, so a fresh mapping.
plain = allocate_kv_cache(load_model_config_135m(), 100, 16, torch.bfloat16)
print("hg" in vma_flags(plain.data_ptr()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_a_cpu_cache_can_stay_off_huge_pages() -> None:
    # In a fresh process: here, glibc may hand out heap memory that an earlier test advised
    # and freed (a clean-clone CI run did), and its mapping keeps that advice.
    assert HUGE_PAGES_ENV == "KVRELAY_HUGE_PAGES"
    assert run_fresh_python(_PLAIN_CACHE, "services", "kernels").strip() == "False"


def test_a_cache_on_another_device_is_allocated_there() -> None:
    cache = allocate_kv_cache(
        CONFIG, num_blocks=4, block_size=16, dtype=torch.float32, device="meta"
    )
    assert cache.is_meta and cache.shape == (4, 30, 2, 16, 3, 64)
