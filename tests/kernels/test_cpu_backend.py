"""kvrelay's C++ CPU decode attention against the torch reference."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from kvrelay_kernels import build_plan, cpu_backend, reference, select_backend
from tests.kernels.paged_batch import make_paged_batch

pytestmark = pytest.mark.skipif(
    not cpu_backend.is_available(), reason="the CPU kernel does not build here"
)


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([1], [1]),
        ([40], [1]),  # fewer sequences than threads: one item per KV head, blocks read ahead
        ([37, 5, 16, 64], [1, 1, 1, 1]),  # all decodes, unequal lengths
        ([9, 30, 4], [1, 7, 1]),  # decodes mixed with a prefill chunk
    ],
)
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "dim"),
    # blocks under, at and over the kernel's 16-key tile; groups over its 4-head tile;
    # head dims under and between its 16 lanes
    [(4, 2, 3, 8), (16, 3, 3, 64), (16, 1, 8, 20), (32, 2, 5, 48)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_the_reference(
    seq_lens: list[int],
    q_lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    dim: int,
    dtype: torch.dtype,
) -> None:
    batch = make_paged_batch(
        seq_lens, q_lens, block_size, kv_heads, group, dim, num_layers=3, seed=sum(seq_lens)
    )
    query, kv_cache = batch.query.to(dtype), batch.kv_cache.to(dtype)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, block_size)
    for layer in (0, 2):
        got = cpu_backend.paged_attention(query, kv_cache, layer, tables, lens, qsl, 0.3, plan=plan)
        assert got.dtype == dtype
        if dtype == torch.float32:
            expected = reference.paged_attention(
                query, kv_cache, layer, tables, lens, qsl, 0.3, plan=plan
            )
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:
            # The kernel widens bf16 to fp32 and rounds once at the end: held to the fp32
            # reference over the same bf16 inputs, within one bf16 rounding.
            expected = reference.paged_attention(
                query.float(), kv_cache.float(), layer, tables, lens, qsl, 0.3, plan=plan
            )
            torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize("threads", [1, 3])
def test_kv_heads_split_or_together_give_the_same_output(threads: int) -> None:
    """With fewer sequences than threads each KV head is a work item of its own; with more, a
    sequence's heads are read in one pass. Both are held to the reference."""
    batch = make_paged_batch([70, 3], [1, 1], 16, 3, 3, 64, num_layers=2, seed=threads)
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    plan = build_plan(tables, lens, qsl, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_backend.paged_attention(
            batch.query, batch.kv_cache, 1, tables, lens, qsl, 0.125, plan=plan
        )
    finally:
        torch.set_num_threads(before)
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, 1, tables, lens, qsl, 0.125, plan=plan
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("objdump") is None,
    reason="reads x86 machine code with objdump",
)
def test_the_built_kernel_asks_for_blocks_ahead() -> None:
    """GCC's vectorizer once deleted every __builtin_prefetch of this kernel (its loop of
    prefetches was vectorized into an empty one), silently: decode attention then waited on
    memory at every block, at half its speed. The built code must hold the instructions (into
    L2: prefetcht0 into L1 read at about half the speed)."""
    module = cpu_backend.load_extension()
    assert module is not None and module.__file__ is not None
    code = subprocess.run(
        ["objdump", "-d", module.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert code.count("prefetcht2") >= 2  # at least one per dtype the kernel is built for
    assert "prefetcht0" not in code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fills_the_same_slots_as_the_reference(dtype: torch.dtype) -> None:
    """Keys viewed with strided rows (as out of a fused QKV output), padding slots skipped,
    other layers and slots untouched."""
    torch.manual_seed(0)
    kv_heads, dim, block_size = 3, 8, 4
    fused = torch.randn(6, 3 * kv_heads * dim).to(dtype)
    key = fused[:, : kv_heads * dim].view(6, kv_heads, dim)
    value = fused[:, kv_heads * dim : 2 * kv_heads * dim].view(6, kv_heads, dim)
    assert key.stride(0) != kv_heads * dim  # the strided-rows case the kernel reads in place
    slots = torch.tensor([5, -1, 0, 13, -1, 7])
    ours = torch.randn(4, 2, 2, block_size, kv_heads, dim).to(dtype)
    theirs = ours.clone()
    cpu_backend.write_kv(key, value, ours, 1, slots)
    reference.write_kv(key, value, theirs, 1, slots)
    assert torch.equal(ours, theirs)


def test_write_kv_refuses_a_slot_past_the_cache() -> None:
    cache = torch.zeros(2, 1, 2, 4, 1, 8)
    before = cache.clone()
    key = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_backend.write_kv(key, key, cache, 0, torch.tensor([8]))
    assert torch.equal(cache, before)


def test_bf16_decode_rows_run_in_the_kernel() -> None:
    """A bf16 decode step does not fall back to the torch reference (which gathers K/V)."""
    batch = make_paged_batch([40, 7], [1, 1], 16, 2, 3, 64, num_layers=1, seed=3)
    query, kv_cache = batch.query.bfloat16(), batch.kv_cache.bfloat16()
    tables, lens, qsl = batch.block_tables, batch.seq_lens, batch.query_start_loc
    module = cpu_backend.load_extension()
    assert module is not None
    direct = module.paged_decode_attention(
        query.contiguous(), kv_cache, 0, tables.long(), lens.long(), 0.3
    )
    got = cpu_backend.paged_attention(query, kv_cache, 0, tables, lens, qsl, 0.3)
    assert torch.equal(got, direct)  # the same bits: the kernel's, not SDPA's
    mixed = cpu_backend.paged_attention(query, kv_cache.float(), 0, tables, lens, qsl, 0.3)
    # A cache of another dtype goes the reference's way (the kernel refuses it): same values.
    torch.testing.assert_close(mixed.float(), got.float(), atol=1e-2, rtol=2**-7)


def test_auto_selects_the_cpu_backend() -> None:
    assert select_backend("auto").name == "cpu"
    assert select_backend("torch").name == "torch"
