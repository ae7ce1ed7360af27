"""The pool of KV blocks: a free queue, reference counts and the prefix cache's hash map.

A block id indexes dimension 0 of the worker's block-major KV tensor. The pool never touches
the tensor and knows nothing about requests; it only says who owns which block and which
free blocks still hold reusable content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvrelay.common.block_hash import BlockHash


class BlockPool:
    """Hands out block ids, takes them back when their last owner lets go, and remembers
    which full blocks hold which content (when `enable_caching`).

    Free queue (head = next to be allocated)::

        [ free blocks without a hash ... | cached free blocks, least recently used first ... ]

    A freed block without a hash holds nothing worth keeping, so it goes to the head (with
    caching on); a freed cached block goes to the tail. Allocation takes from the head and
    evicts a cached block (drops its hash) only when no uncached block is free. A request's
    blocks are released tail first, so the end of a chain is evicted before its start, which
    keeps the cached prefixes reachable. With caching off no block has a hash and every freed
    block goes to the tail (the pre-cache behaviour).

    Invariants (checked by `check_invariants`, asserted in tests):
    - a block is in the free queue exactly when its reference count is 0;
    - the hash map and the per-block hashes agree, one block per hash;
    - in the free queue every uncached block comes before every cached one (caching on).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        # An OrderedDict for O(1) removal of a free cached block on a cache hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request owns, cached ones included (they can be evicted at any time)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def ref_counts(self, block_ids: Iterable[int], count: int) -> npt.NDArray[np.int64]:
        """The reference counts of `count` blocks at once (read in C: the scheduler asks
        this of every running decode's last block every step)."""
        return np.fromiter(map(self._ref_counts.__getitem__, block_ids), np.int64, count)

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def free_block_ids(self) -> Iterator[int]:
        """The free queue from head (next allocated) to tail; for tests and debugging."""
        return iter(self._free)

    def cached_hashes(self) -> list[BlockHash]:
        """The hashes of every block holding cached content now (in use or free)."""
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`'s content, or None. Changes nothing."""
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` free blocks, each with reference count 1, evicting cached ones if needed.

        Returns:
            The block ids, or None (and nothing taken) when fewer than `count` are free.
        """
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one owner to each of `block_ids` (cache hits), taking free ones off the queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                assert self._hashes[block_id] is not None, f"touching uncached free {block_id}"
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one owner to each of `block_ids`, which must be in use."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"sharing free block {block_id}"
            self._ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that the in-use, full `block_id` holds `block_hash`'s content.

        Returns:
            False (nothing changed) when caching is off or another block already holds that
            content (two requests computed the same prefix at once): the first one stays.
        """
        assert self._ref_counts[block_id] > 0, f"caching free block {block_id}"
        if not self.enable_caching or block_hash in self._cached:
            return False
        assert self._hashes[block_id] is None, f"block {block_id} is already cached"
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one owner of each block; a block with no owner left goes to the free queue.

        Blocks are released in reverse so that the tail of a sequence is evicted before its
        head.
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if self.enable_caching and self._hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's content.

        Returns:
            False (nothing changed) while any block is in use, as vLLM does; True otherwise.
        """
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        return True

    def uncache(self, block_hash: BlockHash) -> bool:
        """Drop one hash from the cache (its block, in use or free, keeps its place).

        Returns:
            False when the hash was not cached.
        """
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return False
        self._evict(block_id)
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            self._hashes[block_id] = None
            del self._cached[block_hash]
            self.num_evictions += 1

    def check_invariants(self) -> None:
        """Raise AssertionError if the free queue, reference counts and hashes disagree."""
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has reference count {count}"
            assert (count == 0) == (block_id in self._free), (
                f"block {block_id}: reference count {count}, free: {block_id in self._free}"
            )
        hashed = {h: b for b, h in enumerate(self._hashes) if h is not None}
        assert hashed == self._cached, "the hash map and the block hashes disagree"
        if self.enable_caching:
            seen_cached = False
            for block_id in self._free:
                is_cached = self._hashes[block_id] is not None
                assert is_cached or not seen_cached, f"uncached free {block_id} after a cached"
                seen_cached = seen_cached or is_cached

    def is_whole(self) -> bool:
        """True when no block is in use (cached free blocks count as free): nothing leaked."""
        return len(self._free) == self.num_blocks
