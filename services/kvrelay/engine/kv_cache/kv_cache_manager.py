"""Per-request block tables over the block pool: prefix-cache lookup, growth, forks, CoW.

Token `t` of a request lives in block `table[t // block_size]` at offset `t % block_size`.
Which requests run, and when, is the scheduler's business; this file only keeps the tables.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvrelay.common.block_hash import BlockHash, extend_block_hashes
from kvrelay.engine.kv_cache.block_pool import BlockPool
from kvrelay.engine.request import Request

# decodes_fit: a request with no table reads as one of length 0; its last block.
_NO_TABLE: list[int] = []
_LAST = operator.itemgetter(-1)
Fits = tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]] | None


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (vLLM's definitions)."""

    queries: int = 0  # tokens of every admitted request (prompt + output, when recomputed)
    hits: int = 0  # of those, tokens found in the cache (not computed again)


class TableChanges(NamedTuple):
    """`take_changed`'s answer: tables changed in any way, and tables only one block longer
    (not among the first)."""

    changed: set[str]
    appended: set[str]


class KVCacheManager:
    """Grows, shares and frees the block table of each request.

    With `enable_caching`, every full block a request computed is registered under its chain
    hash (`block_hash.py`, keyed also by `extra_keys`), and admission reuses the longest cached
    prefix. The last, partial block is never cached, hence never found by a lookup; it is only
    shared by `fork`, and copied (copy-on-write) before the next write into it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = False,
        extra_keys: Sequence[str] = (),
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_keys = tuple(extra_keys)
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already registered in the cache (or found there).
        self._num_cached: dict[str, int] = {}
        # Copy-on-write copies (src, dst) decided since the last `take_copies`, per request.
        self._copies: dict[str, list[tuple[int, int]]] = {}
        # Requests whose table changed (grown, a block replaced, created, freed) since the
        # last `take_changed`: the runner's persistent batch rewrites only their rows.
        self._changed: set[str] = set()
        # Those whose table only grew by one block (`append_blocks`): one entry each.
        self._appended: set[str] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in token order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def num_requests(self) -> int:
        return len(self._tables)

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chain hashes of `request`'s first `num_blocks` full blocks (memoized on it)."""
        return self._hashed(request, num_blocks)[:num_blocks]

    def _hashed(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """`request`'s memo of chain hashes, extended to at least `num_blocks` blocks: only
        the new blocks' tokens are read."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            size = self.block_size
            tokens = request.token_ids(len(hashes) * size, num_blocks * size)
            extend_block_hashes(hashes, tokens, size, self.extra_keys)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The blocks of the longest cached prefix of `request`'s tokens. Changes nothing.

        The hit stops at a block boundary at most `num_tokens - 1`: at least the last token
        is computed, so the step has logits to sample from, and no token is ever written into
        a block found here.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self.block_hashes(request, max_blocks):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        *,
        num_computed_tokens: int = 0,
        cached_blocks: Sequence[int] = (),
    ) -> bool:
        """Make room for the first `num_total_tokens` tokens of a request.

        Args:
            num_computed_tokens: tokens already in the cache; tokens from here on are written
                this step, so a shared block they land in is first copied (copy-on-write: a
                new block replaces it in the table, the copy is queued for `take_copies`).
            cached_blocks: for a request without blocks, the prefix found by
                `find_cached_prefix`; they start its table, shared.

        Returns:
            True when the request's table now covers `num_total_tokens` tokens; False (and
            nothing changed) when the pool has too few free blocks this step.
        """
        table = self._tables.get(request_id, [])
        assert not (table and cached_blocks), "cached blocks are only for a new table"
        pool = self.pool
        if self._fits_unshared(table, num_total_tokens, num_computed_tokens):
            return True  # most decodes: the token lands in a block the request owns alone
        first_written = num_computed_tokens // self.block_size
        cow = [i for i in range(first_written, len(table)) if pool.ref_count(table[i]) > 1]
        have = len(table) + len(cached_blocks)
        need = max(blocks_needed(num_total_tokens, self.block_size) - have, 0) + len(cow)
        # A free cached block that is hit leaves the free queue: it cannot be allocated too.
        free_hits = sum(1 for block_id in cached_blocks if pool.ref_count(block_id) == 0)
        if need > pool.num_free_blocks - free_hits:
            return False
        if request_id not in self._tables:
            self._tables[request_id] = table
            self._num_cached[request_id] = len(cached_blocks)
        self._changed.add(request_id)
        pool.touch(cached_blocks)
        table.extend(cached_blocks)
        new_blocks = pool.allocate(need)
        assert new_blocks is not None, "free blocks were counted above"
        for index in cow:
            src, dst = table[index], new_blocks.pop()
            assert pool.block_hash(src) is None, "a cached (full) block is never written"
            table[index] = dst
            pool.free([src])
            self._copies.setdefault(request_id, []).append((src, dst))
        table.extend(new_blocks)
        return True

    def decode_fits(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether the request's next token (at `num_computed_tokens`) fits its table with
        no allocation and no copy: `allocate_slots` for it would return True and change
        nothing. The scheduler asks this of every running decode every step."""
        table = self._tables.get(request_id)
        if not table:
            return False
        first = num_computed_tokens // self.block_size
        if first == len(table) - 1:  # the usual case: the token lands in the last block
            return self.pool.ref_count(table[first]) == 1
        return self._fits_unshared(table, num_computed_tokens + 1, num_computed_tokens)

    def decodes_fit(self, request_ids: Sequence[str], starts: npt.NDArray[np.int64]) -> Fits:
        """`decode_fits`' usual cases for a whole batch at once, read in C and numpy.

        Returns:
            Two masks over the requests: whether each one's next token (at `starts[i]`)
            lands in the last block of its table, a block it owns alone (`decode_fits` is
            True), and whether it opens a new block after a table of full blocks (what
            `append_blocks` gives it). A row False in both must be asked one by one (a
            copy-on-write, a table longer than the tokens). None when some request holds
            no blocks.
        """
        n = len(request_ids)
        tables = list(map(self._tables.get, request_ids, repeat(_NO_TABLE, n)))
        lengths = np.fromiter(map(len, tables), np.int64, n)
        if not lengths.all():
            return None
        last_block = lengths - 1 == starts // self.block_size
        alone = self.pool.ref_counts(map(_LAST, tables), n) == 1
        return last_block & alone, lengths * self.block_size == starts

    def append_blocks(self, request_ids: Sequence[str]) -> None:
        """One new block at the end of each request's table, taken from the pool in order:
        for decodes whose token opens a block (`decodes_fit`), the same as `allocate_slots`
        for each in turn. The caller has counted the free blocks."""
        new_blocks = self.pool.allocate(len(request_ids))
        assert new_blocks is not None, "append_blocks: fewer free blocks than requests"
        tables = self._tables
        for request_id, block in zip(request_ids, new_blocks, strict=True):
            tables[request_id].append(block)
        appended = self._appended
        self._changed.update(appended.intersection(request_ids))  # a second block: rewrite
        appended.update(request_ids)

    def _fits_unshared(self, table: list[int], num_total: int, num_computed: int) -> bool:
        """Whether the table already holds `num_total` tokens and every block written from
        `num_computed` on has this request as its only owner (no allocation, no copy)."""
        if not table or num_total > len(table) * self.block_size:
            return False
        ref_count = self.pool.ref_count
        return all(ref_count(b) == 1 for b in table[num_computed // self.block_size :])

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache (after a step)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached[rid]
        if num_full <= done:
            return
        table = self._tables[rid]
        hashes = self._hashed(request, num_full)  # the memo itself: no copy of the chain
        for index in range(done, num_full):
            self.pool.cache_block(table[index], hashes[index])
        self._num_cached[rid] = num_full

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the same blocks as `parent_id`, shared (n > 1 after the prefill)."""
        assert child_id not in self._tables, f"{child_id} already holds blocks"
        table = list(self._tables[parent_id])
        self.pool.share(table)
        self._tables[child_id] = table
        self._num_cached[child_id] = self._num_cached[parent_id]
        self._changed.add(child_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies decided since the last call; the runner performs them
        before the forward pass that writes into dst."""
        copies = [pair for pairs in self._copies.values() for pair in pairs]
        self._copies.clear()
        return copies

    def take_changed(self) -> TableChanges:
        """The requests whose table changed since the last call (each table's blocks may have
        grown, been replaced by a copy-on-write block, been created or freed), and apart
        those whose only change is one block appended."""
        changed, self._changed = self._changed, set()
        appended, self._appended = self._appended, set()
        return TableChanges(changed, appended - changed)

    def free(self, request_id: str) -> None:
        """Release every block of the request (a no-op if it holds none). Full blocks stay
        cached until their memory is needed."""
        table = self.release(request_id)
        if table:
            self.pool.free(table)

    def release(self, request_id: str) -> list[int]:
        """`free` but for the pool: the request no longer holds its blocks here (its id may
        be used again at once), and the caller hands them to `pool.free` later (async
        scheduling: once no launched step reads or writes them)."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self._changed.add(request_id)
        self._num_cached.pop(request_id, None)
        # A copy into a block just released must not run: the block may be reused this step.
        self._copies.pop(request_id, None)
        return table or []

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content. Returns False (nothing changed) while blocks are in use."""
        return self.pool.reset_prefix_cache()
