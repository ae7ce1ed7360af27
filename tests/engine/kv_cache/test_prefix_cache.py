"""Prefix cache with exact block ids: reuse, no partial-block reuse, LRU eviction, CoW, reset."""

from __future__ import annotations

from kvrelay.common.block_hash import (
    ROOT_HASH,
    hash_block_tokens,
    hash_token_blocks,
)
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=10), max_total_tokens=1000)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit with the cache, compute the whole prompt, register its full blocks."""
    cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request.request_id, request.num_tokens, cached_blocks=cached)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return cached


def free_queue(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_block_ids())


def test_hash_is_a_documented_sha256_chain() -> None:
    import hashlib
    import struct

    expected = hashlib.sha256(
        ROOT_HASH + struct.pack("<I2q", 2, 7, 9) + struct.pack("<II", 1, 1) + b"m"
    ).digest()
    assert hash_block_tokens(ROOT_HASH, [7, 9], ("m",)) == expected
    # A pinned value: the same in every process and release (Python's hash() is randomized).
    assert expected.hex() == ("c74b319b0433b4a1632f31ddefd7425c0f1cd477bcfc9e91754aff91403769f1")
    first, second = hash_token_blocks([7, 9, 1, 2, 5], 2, ("m",))
    assert first == expected
    assert second == hash_block_tokens(first, [1, 2], ("m",))
    assert hash_token_blocks([7, 9], 2, ("other",))[0] != first  # the model is part of the key


def test_cached_prefix_is_reused_and_only_the_rest_allocated() -> None:
    kv = KVCacheManager(10, 4, enable_caching=True)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == []
    assert kv.block_table("a") == [0, 1, 2]
    b = make_request("b", [*range(8), 50, 51, 52])
    assert admit(kv, b) == [0, 1]
    assert kv.block_table("b") == [0, 1, 3]
    assert [kv.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)  # counted by the scheduler
    kv.free("a")
    kv.free("b")
    # Uncached partial blocks (2, then 3) go to the head; the chain's tail (1) before its head.
    assert free_queue(kv) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    c = make_request("c", [*range(8), 60])
    assert admit(kv, c) == [0, 1]  # free cached blocks are hit, taken off the free queue
    assert kv.block_table("c") == [0, 1, 3]
    assert free_queue(kv) == [2, 4, 5, 6, 7, 8, 9]
    kv.free("c")
    assert kv.pool.is_whole()
    kv.pool.check_invariants()


def test_partial_last_block_is_never_reused() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    admit(kv, make_request("a", list(range(6))))
    assert kv.pool.block_hash(1) is None  # 2 tokens in block 1: not cached
    again = make_request("again", list(range(6)))
    assert kv.find_cached_prefix(again) == [0]
    longer = make_request("longer", list(range(9)))
    assert kv.find_cached_prefix(longer) == [0]


def test_whole_prompt_cached_still_computes_its_last_block() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    admit(kv, make_request("a", list(range(8))))
    assert kv.pool.num_cached_blocks == 2
    # The hit stops at a block boundary <= 7 tokens: block 1 is computed again, in a new block.
    same = make_request("same", list(range(8)))
    assert admit(kv, same) == [0]
    assert kv.block_table("same") == [0, 2]


def test_eviction_takes_uncached_blocks_first_then_least_recently_used_tail_first() -> None:
    kv = KVCacheManager(6, 2, enable_caching=True)
    admit(kv, make_request("a", [1, 2, 3, 4]))  # blocks 0, 1
    admit(kv, make_request("b", [5, 6, 7, 8]))  # blocks 2, 3
    kv.free("a")
    kv.free("b")
    assert free_queue(kv) == [4, 5, 1, 0, 3, 2]
    filler = make_request("filler", [90, 91, 92, 93, 94])  # 3 blocks
    admit(kv, filler)
    # Uncached 4 and 5 first, then the least recently used chain's tail: a's block 1.
    assert kv.block_table("filler") == [4, 5, 1]
    assert kv.pool.num_evictions == 1
    assert kv.find_cached_prefix(make_request("a2", [1, 2, 3, 4, 9])) == [0]
    assert kv.find_cached_prefix(make_request("b2", [5, 6, 7, 8, 9])) == [2, 3]
    kv.free("filler")
    assert kv.pool.is_whole()


def test_a_hit_refreshes_recency() -> None:
    kv = KVCacheManager(4, 2, enable_caching=True)
    admit(kv, make_request("a", [1, 2, 3]))  # blocks 0 (cached), 1
    kv.free("a")
    admit(kv, make_request("b", [5, 6, 7]))  # blocks 1 (uncached head first, cached), 2
    kv.free("b")
    assert free_queue(kv) == [2, 3, 0, 1]
    admit(kv, make_request("a2", [1, 2, 9]))  # hits 0, gets block 2
    kv.free("a2")
    assert free_queue(kv) == [2, 3, 1, 0]  # 0 is now the most recently used
    admit(kv, make_request("x", [70, 71, 72, 73, 74, 75]))  # 3 blocks: evicts b's block 1
    assert kv.block_table("x") == [2, 3, 1]
    assert kv.find_cached_prefix(make_request("a3", [1, 2, 8])) == [0]


def test_fork_shares_blocks_and_a_write_copies_the_shared_partial_block() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    leader = make_request("g#0", list(range(6)))
    admit(kv, leader)
    kv.fork("g#0", "g#1")
    kv.fork("g#0", "g#2")
    assert kv.block_table("g#1") == [0, 1]
    assert kv.pool.ref_count(1) == 3
    # g#1 writes token 6 into the shared block 1: it gets a copy.
    assert kv.allocate_slots("g#1", 7, num_computed_tokens=6)
    assert kv.block_table("g#1") == [0, 2]
    assert kv.allocate_slots("g#2", 7, num_computed_tokens=6)
    assert kv.block_table("g#2") == [0, 3]
    # The last owner writes in place; the full block 0 stays shared.
    assert kv.allocate_slots("g#0", 7, num_computed_tokens=6)
    assert kv.block_table("g#0") == [0, 1]
    assert kv.take_copies() == [(1, 2), (1, 3)]
    assert kv.take_copies() == []
    assert [kv.pool.ref_count(i) for i in range(4)] == [3, 1, 1, 1]
    for rid in ("g#0", "g#1", "g#2"):
        kv.free(rid)
    assert kv.pool.is_whole()
    kv.pool.check_invariants()


def test_a_freed_request_drops_its_pending_copy() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    admit(kv, make_request("g#0", list(range(6))))
    kv.fork("g#0", "g#1")
    assert kv.allocate_slots("g#1", 7, num_computed_tokens=6)
    kv.free("g#1")  # preempted in the same schedule: its copy must not run
    assert kv.take_copies() == []
    kv.free("g#0")
    assert kv.pool.is_whole()


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    kv = KVCacheManager(4, 2, enable_caching=True)
    admit(kv, make_request("a", [1, 2, 3]))
    assert not kv.reset_prefix_cache()
    assert kv.pool.num_cached_blocks == 1
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3])) == []
    kv.pool.check_invariants()


def test_caching_off_caches_nothing_and_keeps_the_old_free_order() -> None:
    kv = KVCacheManager(4, 2)
    admit(kv, make_request("a", [1, 2, 3]))
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3])) == []
    kv.free("a")
    assert free_queue(kv) == [2, 3, 1, 0]


def test_decoded_blocks_hash_as_the_whole_sequence_does() -> None:
    """A decode that fills a block hashes only the new block's tokens, chained to the last
    hash; the chain equals the hashes of the whole sequence at once (what another engine or
    the router computes), across the prompt / output seam and block by block."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, extra_keys=("m",))
    request = make_request("d", [3, 1, 4, 1, 5, 9])  # one full block, two tokens over
    admit(kv, request)
    assert request.block_hashes == hash_token_blocks(request.prompt_token_ids, 4, ("m",))
    for token in [2, 6, 5, 3, 5, 8, 9, 7]:  # decodes: one token, its KV computed
        request.output_token_ids.append(token)
        assert kv.allocate_slots(
            request.request_id,
            request.num_computed_tokens + 1,
            num_computed_tokens=request.num_computed_tokens,
        )
        request.num_computed_tokens += 1
        kv.cache_full_blocks(request)
        everything = request.prompt_token_ids + request.output_token_ids
        assert request.block_hashes == hash_token_blocks(everything, 4, ("m",))
    assert len(request.block_hashes) == 3
    table = kv.block_table("d")
    assert [kv.pool.lookup(h) for h in request.block_hashes] == table[:3]
