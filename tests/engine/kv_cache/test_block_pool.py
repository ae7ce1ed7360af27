"""Block pool and block tables: exact ids, reference counts, and invariants under any order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.engine.kv_cache.block_pool import BlockPool
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager, blocks_needed


def test_allocate_hands_out_lowest_free_ids_first() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_allocate_too_many_takes_nothing() -> None:
    pool = BlockPool(3)
    assert pool.allocate(4) is None
    assert pool.num_free_blocks == 3


def test_freed_blocks_are_reused_last_tail_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    pool.free(blocks)
    # Block 3 was never used, then the freed tail (2) comes back before the head (0).
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_shared_block_is_free_only_after_last_owner() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1) or []
    pool.share([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.is_whole()


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1) or []
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_pool_rejects_empty_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_block_table_grows_by_whole_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 5)
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 8)  # still fits in two blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 9)
    assert kv.block_table("a") == [0, 1, 2]
    assert not kv.allocate_slots("b", 4 * 6)  # 6 blocks needed, 5 free: nothing taken
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 5
    kv.free("a")
    assert kv.pool.is_whole()


def test_blocks_needed() -> None:
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 24),
    ops=st.lists(
        st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
        max_size=60,
    ),
)
def test_no_block_owned_twice_and_pool_whole_after_all_freed(
    num_blocks: int, ops: list[tuple[str, int, int]]
) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    sizes: dict[str, int] = {}
    for op, who, tokens in ops:
        rid = f"r{who}"
        if op == "grow":
            total = sizes.get(rid, 0) + tokens
            if kv.allocate_slots(rid, total):
                sizes[rid] = total
        else:
            kv.free(rid)
            sizes.pop(rid, None)
        owned = [b for rid in sizes for b in kv.block_table(rid)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + kv.num_free_blocks == num_blocks
        for rid, total in sizes.items():
            assert len(kv.block_table(rid)) == blocks_needed(total, 4)
        kv.pool.check_invariants()
    for rid in list(sizes):
        kv.free(rid)
    assert kv.pool.is_whole()
    kv.pool.check_invariants()
