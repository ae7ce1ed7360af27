"""Model-based test of the prefix cache: random admit / compute / decode / fork / finish /
abort / evict / reset sequences against a reference that tracks contents, not block ids."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.common.block_hash import BlockHash, hash_token_blocks
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager, blocks_needed
from kvrelay.engine.request import Request

BS = 2
NUM_BLOCKS = 12
KEYS = ("model",)
# A tiny alphabet, so that prompts often share prefixes.
TOKENS = st.integers(1, 3)

# A block of a live sequence in the reference: ("c", prefix) for a cached block (its content
# is tokens[:end of block]), ("o", n) for an uncached one (n identifies it).
Entry = tuple[str, object]


@dataclass
class Seq:
    request: Request
    entries: list[Entry] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.request.token_ids(0, self.request.num_tokens)


def prefix_hash(prefix: tuple[int, ...]) -> BlockHash:
    return hash_token_blocks(prefix, BS, KEYS)[-1]


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True, extra_keys=KEYS)
        self.live: list[Seq] = []
        self.ids = itertools.count()
        # The reference: what must be free, cached and shared.
        self.uncached_free = NUM_BLOCKS
        self.lru: OrderedDict[tuple[int, ...], None] = OrderedDict()  # cached free, LRU first
        self.cached_refs: dict[tuple[int, ...], int] = {}  # cached in use -> owners
        self.own_refs: dict[int, int] = {}  # uncached in use -> owners
        self.evictions = 0

    # --- the reference's own bookkeeping -------------------------------------------------

    def _is_cached(self, prefix: tuple[int, ...]) -> bool:
        return prefix in self.lru or prefix in self.cached_refs

    def _ref_take_blocks(self, count: int) -> list[Entry]:
        assert count <= self.uncached_free + len(self.lru)
        from_uncached = min(count, self.uncached_free)
        self.uncached_free -= from_uncached
        for _ in range(count - from_uncached):
            self.lru.popitem(last=False)
            self.evictions += 1
        entries: list[Entry] = []
        for _ in range(count):
            uid = next(self.ids)
            self.own_refs[uid] = 1
            entries.append(("o", uid))
        return entries

    def _ref_release(self, entries: list[Entry]) -> None:
        for kind, key in reversed(entries):
            if kind == "c":
                assert isinstance(key, tuple)
                self.cached_refs[key] -= 1
                if self.cached_refs[key] == 0:
                    del self.cached_refs[key]
                    self.lru[key] = None
            else:
                assert isinstance(key, int)
                self.own_refs[key] -= 1
                if self.own_refs[key] == 0:
                    del self.own_refs[key]
                    self.uncached_free += 1

    def _refs(self, entry: Entry) -> int:
        kind, key = entry
        return self.cached_refs[key] if kind == "c" else self.own_refs[key]  # type: ignore[index]

    def _grow(self, seq: Seq, total: int) -> bool:
        """allocate_slots on both sides, copy-on-write included; True if it fitted."""
        req = seq.request
        first = req.num_computed_tokens // BS
        cow = [i for i in range(first, len(seq.entries)) if self._refs(seq.entries[i]) > 1]
        need = max(blocks_needed(total, BS) - len(seq.entries), 0) + len(cow)
        fits = need <= self.uncached_free + len(self.lru)
        ok = self.kv.allocate_slots(
            req.request_id, total, num_computed_tokens=req.num_computed_tokens
        )
        assert ok == fits
        if ok:
            new = self._ref_take_blocks(need)
            for index in cow:
                assert seq.entries[index][0] == "o", "a cached block is never written"
                self._ref_release([seq.entries[index]])
                seq.entries[index] = new.pop()
            seq.entries.extend(new)
        self.kv.take_copies()
        return ok

    def _computed(self, seq: Seq, upto: int) -> None:
        """Both sides register the full blocks computed so far."""
        req = seq.request
        before = req.num_computed_tokens // BS
        req.num_computed_tokens = upto
        self.kv.cache_full_blocks(req)
        tokens = seq.tokens
        for index in range(before, upto // BS):
            kind = seq.entries[index][0]
            prefix = tuple(tokens[: (index + 1) * BS])
            if kind == "o" and not self._is_cached(prefix):
                assert self._refs(seq.entries[index]) == 1, "a block is computed by one owner"
                self._ref_release([seq.entries[index]])
                self.uncached_free -= 1
                self.cached_refs[prefix] = 1
                seq.entries[index] = ("c", prefix)

    # --- rules ----------------------------------------------------------------------------

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=9), chunk=st.integers(1, 9))
    def admit(self, tokens: list[int], chunk: int) -> None:
        rid = f"r{next(self.ids)}"
        req = Request(rid, tokens, SamplingParams(), max_total_tokens=10**6)
        max_blocks = (len(tokens) - 1) // BS
        hits: list[tuple[int, ...]] = []
        for i in range(max_blocks):
            prefix = tuple(tokens[: (i + 1) * BS])
            if not self._is_cached(prefix):
                break
            hits.append(prefix)
        cached = self.kv.find_cached_prefix(req)
        assert len(cached) == len(hits), "the hit is the longest cached prefix"
        for block_id, prefix in zip(cached, hits, strict=True):
            assert self.kv.pool.block_hash(block_id) == prefix_hash(prefix)
        start = len(hits) * BS
        total = min(len(tokens), start + chunk)
        need = blocks_needed(total, BS) - len(hits)
        free_hits = sum(1 for p in hits if p in self.lru)
        fits = need <= self.uncached_free + len(self.lru) - free_hits
        ok = self.kv.allocate_slots(rid, total, cached_blocks=cached)
        assert ok == fits
        if not ok:
            return
        for prefix in hits:
            if prefix in self.lru:
                del self.lru[prefix]
            self.cached_refs[prefix] = self.cached_refs.get(prefix, 0) + 1
        seq = Seq(req, [("c", p) for p in hits])
        seq.entries.extend(self._ref_take_blocks(need))
        req.num_computed_tokens = start
        self.live.append(seq)
        self._computed(seq, total)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 9), token=TOKENS)
    def compute(self, pick: int, chunk: int, token: int) -> None:
        seq = self.live[pick % len(self.live)]
        req = seq.request
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(token)  # a sampled token, computed by the next step
        total = min(req.num_tokens, req.num_computed_tokens + chunk)
        if self._grow(seq, total):
            self._computed(seq, total)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick: int) -> None:
        seq = self.live[pick % len(self.live)]
        parent = seq.request
        if parent.num_computed_tokens != parent.num_tokens:
            return  # forks happen after a sampling step only
        rid = f"r{next(self.ids)}"
        child = Request(rid, parent.prompt_token_ids, SamplingParams(), max_total_tokens=10**6)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent.request_id, rid)
        for kind, key in seq.entries:
            if kind == "c":
                self.cached_refs[key] += 1  # type: ignore[index]
            else:
                self.own_refs[key] += 1  # type: ignore[index]
        self.live.append(Seq(child, list(seq.entries)))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), finished=st.booleans())
    def finish_or_abort(self, pick: int, finished: bool) -> None:
        seq = self.live[pick % len(self.live)]
        if finished and seq.request.num_computed_tokens < seq.request.num_tokens - 1:
            return  # a finished sequence computed all but its last sampled token
        self.live.remove(seq)
        self.kv.free(seq.request.request_id)
        self._ref_release(seq.entries)

    @rule(count=st.integers(1, NUM_BLOCKS))
    def evict(self, count: int) -> None:
        """Memory pressure: a one-off request of unique tokens takes `count` blocks and ends."""
        tokens = [100 + next(self.ids) for _ in range(count * BS)]
        req = Request(f"r{next(self.ids)}", tokens, SamplingParams(), max_total_tokens=10**6)
        seq = Seq(req)
        self.live.append(seq)
        if self._grow(seq, len(tokens)):
            self._computed(seq, len(tokens))
        self.live.remove(seq)
        self.kv.free(req.request_id)
        self._ref_release(seq.entries)

    @rule()
    def reset(self) -> None:
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.live)
        if ok:
            self.uncached_free += len(self.lru)
            self.lru.clear()

    # --- what must hold after every step --------------------------------------------------

    @invariant()
    def pool_matches_reference(self) -> None:
        pool = self.kv.pool
        pool.check_invariants()
        assert pool.num_free_blocks == self.uncached_free + len(self.lru)
        assert pool.num_cached_blocks == len(self.lru) + len(self.cached_refs)
        assert pool.num_evictions == self.evictions
        free_cached = [pool.block_hash(b) for b in pool.free_block_ids()]
        assert [h for h in free_cached if h is not None] == [prefix_hash(p) for p in self.lru]
        owner_of: dict[Entry, int] = {}
        for seq in self.live:
            table = self.kv.block_table(seq.request.request_id)
            assert len(table) == len(seq.entries)
            for block_id, entry in zip(table, seq.entries, strict=True):
                assert owner_of.setdefault(entry, block_id) == block_id, "one entry, one block"
                assert pool.ref_count(block_id) == self._refs(entry)
                expected = prefix_hash(entry[1]) if entry[0] == "c" else None  # type: ignore[arg-type]
                assert pool.block_hash(block_id) == expected
        assert len(set(owner_of.values())) == len(owner_of), "one block, one entry"

    def teardown(self) -> None:
        for seq in self.live:
            self.kv.free(seq.request.request_id)
        assert self.kv.pool.is_whole(), "KV blocks leaked"
        self.kv.pool.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_prefix_cache_matches_reference = PrefixCacheMachine.TestCase
