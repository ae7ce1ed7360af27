"""Per-request block tables over the block pool: which blocks hold which request's tokens.

Token `t` of a request lives in block `table[t // block_size]` at offset `t % block_size`.
"""

from __future__ import annotations

from kvrelay.engine.kv_cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows and frees the block table of each request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in token order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Make room for the first `num_total_tokens` tokens of a request.

        Returns:
            True when the request's table now covers `num_total_tokens` tokens; False (and
            nothing allocated) when the pool has too few free blocks this step.
        """
        table = self._tables.setdefault(request_id, [])
        missing = blocks_needed(num_total_tokens, self.block_size) - len(table)
        if missing <= 0:
            return True
        new_blocks = self.pool.allocate(missing)
        if new_blocks is None:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(new_blocks)
        return True

    def free(self, request_id: str) -> None:
        """Release every block of the request (a no-op if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def num_requests(self) -> int:
        return len(self._tables)
