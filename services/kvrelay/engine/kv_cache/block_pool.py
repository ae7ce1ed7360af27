"""The pool of KV blocks: a free list and reference counts, nothing about requests.

A block id indexes dimension 0 of the worker's block-major KV tensor. The pool never touches
the tensor; it only says who owns which block.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids and takes them back when their last owner lets go.

    Invariants (checked by `check_invariants`, asserted in tests):
    - a block is on the free list exactly when its reference count is 0;
    - no block is on the free list twice.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Oldest-freed first: a freed block is reused last, which keeps it intact for as long
        # as possible (the prefix cache relies on this order).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` free blocks, each with reference count 1.

        Returns:
            The block ids, or None (and nothing taken) when fewer than `count` are free.
        """
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add one owner to each of `block_ids`, which must be in use."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"sharing free block {block_id}"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one owner of each block; a block with no owner left goes back to the free list.

        Blocks are released in reverse so that the tail of a sequence is reused before its
        head.
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and reference counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has reference count {count}"
            assert (count == 0) == (block_id in free), (
                f"block {block_id}: reference count {count}, on free list: {block_id in free}"
            )

    def is_whole(self) -> bool:
        """True when every block is free: nothing leaked."""
        return len(self._free) == self.num_blocks
