"""The scheduler's whole-batch plain decodes (engine/plain_decodes.py), with pure decode steps
counted computed the short way (`update_after_step(decodes_only=True)`): the same plans, step
for step, as the per-request path alone, over random workloads that preempt, fork, share
prefixes, finish requests mid-batch and (async scheduling) count tokens still in flight."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import SchedulerConfig
from kvrelay.engine import plain_decodes
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.plain_decodes import PlainDecodeFinder
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduled import ScheduledChunk, SchedulerOutput
from kvrelay.engine.scheduler import Scheduler

BLOCK = 4


def _scheduler(budget: int, num_blocks: int, max_seqs: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_caching=True),
    )


@dataclass
class Twin:
    """One scheduler driven as the engine drives it; `plain` False: the per-request path
    decides every row (the finder never answers)."""

    scheduler: Scheduler
    plain: bool
    requests: dict[str, Request] = field(default_factory=dict)
    inflight: list[ScheduledChunk] = field(default_factory=list)  # async: sampled, not read
    plain_rows: int = 0  # rows the finder called plain
    appended_rows: int = 0  # plain rows whose token opened a block (append_blocks)
    decode_updates: int = 0  # pure decode steps counted computed the short way

    def update(self, out: SchedulerOutput) -> None:
        short = self.plain and out.decodes_only
        self.decode_updates += short
        self.scheduler.update_after_step(out.chunks, decodes_only=short)

    def __post_init__(self) -> None:
        finder = self.scheduler._plain_decodes
        find = finder.find

        def counted(running: list[Request]) -> object:
            found = find(running) if self.plain else None
            if found is not None:
                self.plain_rows += int(found[1].sum())
                self._check_fits(running, *found)
            return found

        finder.find = counted  # type: ignore[method-assign]
        kv = self.scheduler.kv_cache
        append = kv.append_blocks

        def appended(request_ids: list[str]) -> None:
            self.appended_rows += len(request_ids)
            append(request_ids)

        kv.append_blocks = appended  # type: ignore[method-assign]

    def _check_fits(
        self, running: list[Request], starts: list[int], plain: np.ndarray, openings: list[int]
    ) -> None:
        """A plain row is one the per-request checks take as a decode that fits, or one
        whose table holds exactly its computed tokens, in full blocks (an opening)."""
        kv = self.scheduler.kv_cache
        for row, (request, start) in enumerate(zip(running, starts, strict=True)):
            if plain[row]:
                assert start == request.num_computed_tokens
                opens = row in openings
                assert kv.decode_fits(request.request_id, start) != opens, request.request_id
                assert (len(kv.block_table(request.request_id)) * BLOCK == start) == opens


def _add(twin: Twin, rid: str, prompt: list[int], max_tokens: int, n: int, prio: int) -> None:
    def request(suffix: str) -> Request:
        made = Request(
            request_id=rid + suffix,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            max_total_tokens=len(prompt) + 64,
            priority=prio,
            arrival_time=float(len(twin.requests)),
        )
        twin.requests[made.request_id] = made
        return made

    leader = request("")
    twin.scheduler.add(leader, [request(f"-{i}") for i in range(1, n)])


def _token(request: Request) -> int:
    return (len(request.output_token_ids) * 31 + len(request.request_id)) % 97


def _append(twin: Twin, chunks: list[ScheduledChunk]) -> None:
    """The sampled tokens of `chunks` appended, as the engine does; a request that reaches
    its max_tokens finishes."""
    s = twin.scheduler
    for chunk in chunks:
        request = chunk.request
        if chunk.samples and not request.is_finished:
            request.output_token_ids.append(_token(request))
            if len(request.output_token_ids) >= request.stop_watch[1]:
                s.finish(request, RequestStatus.FINISHED_LENGTH)


def _step(twin: Twin, overlap: bool) -> SchedulerOutput:
    """One engine step: synchronous, or as async scheduling runs it (the next batch
    scheduled with the last one's tokens in flight, read after)."""
    s = twin.scheduler
    out = s.schedule()
    if not overlap:
        twin.update(out)
        _append(twin, out.chunks)
        return out
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.num_pending += 1
    previous, twin.inflight = twin.inflight, list(out.chunks)
    for chunk in previous:
        if chunk.samples:
            chunk.request.num_pending -= 1
    _append(twin, previous)
    twin.update(out)
    return out


def _summary(out: SchedulerOutput) -> tuple[object, ...]:
    chunks = [
        (c.request.request_id, c.start, c.num_tokens, c.samples, [f.request_id for f in c.forks])
        for c in out.chunks
    ]
    return chunks, [r.request_id for r in out.preempted], out.copies, out.decodes_only


@pytest.fixture(autouse=True)
def _small_batches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-batch reads at any batch size (served: from MIN_ROWS running requests)."""
    monkeypatch.setattr(plain_decodes, "MIN_ROWS", 1)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_plain_decodes_plan_every_step_as_the_per_request_path(seed: int, overlap: bool) -> None:
    rng = random.Random(seed)
    # A budget under the batch (the per-request path alone), a pool that preempts, room.
    configs = [(6, 40, 8), (12, 40, 8), (64, 30, 12), (256, 400, 32)]
    budget, num_blocks, max_seqs = configs[seed % len(configs)]
    twins = [Twin(_scheduler(budget, num_blocks, max_seqs), plain) for plain in (True, False)]
    prefixes = [[rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    for step in range(160):
        if rng.random() < 0.3:  # a new request, often sharing a cached prefix
            prompt = rng.choice(prefixes) + [rng.randrange(97) for _ in range(rng.randint(0, 6))]
            spec = (prompt, rng.randint(1, 30), rng.choice([1, 1, 1, 2, 3]), rng.randint(0, 2))
            for twin in twins:
                _add(twin, f"r{step}", *spec)
        if rng.random() < 0.05:  # an abort of a random unfinished request
            live = sorted(rid for rid, r in twins[0].requests.items() if not r.is_finished)
            if live:
                victim = rng.choice(live)
                for twin in twins:
                    twin.scheduler.finish(twin.requests[victim], RequestStatus.FINISHED_ABORTED)
        plans = [_summary(_step(twin, overlap)) for twin in twins]
        assert plans[0] == plans[1], f"step {step}"
    if budget >= max_seqs:  # every decode fits the budget: the plain path is taken
        assert twins[0].plain_rows > 20, "the workload never reached the plain decode path"
        assert twins[0].appended_rows > 5, "no decode opened a block on the plain path"
    assert twins[0].decode_updates > 10, "no pure decode step was counted the short way"
    for twin in twins:
        twin.scheduler.kv_cache.pool.check_invariants()


def test_a_forked_partial_block_is_not_plain_until_copied() -> None:
    """A leader and its fork share the leader's partial last block: neither's next token
    may be written in place (copy-on-write), so neither row is plain."""
    s = _scheduler(64, 16, 4)
    leader = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8), max_total_tokens=64)
    fork = Request("a-1", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8), max_total_tokens=64)
    s.add(leader, [fork])
    out = s.schedule()
    s.update_after_step(out.chunks)
    for request in (leader, fork):
        request.output_token_ids.append(9)
    running = s._in_service_order()
    found = PlainDecodeFinder(s.kv_cache).find(running)
    assert found is not None
    assert found[0] == [6, 6] and not found[1].any()
    out = s.schedule()  # the per-request path copies the shared block for one of them
    assert len(out.copies) == 1 and len(out.chunks) == 2


def test_a_request_without_blocks_or_not_running_leaves_every_row_to_the_per_request_path() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=4), max_total_tokens=16)
    r.status = RequestStatus.RUNNING
    assert PlainDecodeFinder(kv).find([r]) is None  # no table
    assert kv.decodes_fit(["x"], np.array([3])) is None
    assert kv.allocate_slots("x", 4)
    r.num_computed_tokens = 3
    r.output_token_ids.append(5)  # its first token sampled: the next step decodes it
    found = PlainDecodeFinder(kv).find([r])
    assert found is not None and found[1].tolist() == [True]
    r.status = RequestStatus.PREEMPTED
    assert PlainDecodeFinder(kv).find([r]) is None


def test_decodes_fit_answers_only_for_the_last_block_owned_alone() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    assert kv.allocate_slots("a", 6)  # 2 blocks: token 6 lands in the last one
    assert kv.allocate_slots("b", 8)  # 2 full blocks: token 8 needs a third
    assert kv.allocate_slots("c", 12)  # 3 blocks, 5 computed: token 5 is not in the last
    slots = kv.decodes_fit(["a", "b", "c"], np.array([6, 8, 5]))
    assert slots is not None
    assert slots[0].tolist() == [True, False, False]  # fits in place
    assert slots[1].tolist() == [False, True, False]  # opens a new block
    assert [kv.decode_fits(rid, start) for rid, start in [("a", 6), ("b", 8), ("c", 5)]] == [
        True,
        False,
        True,  # a False is no verdict: the per-request check may still say it fits
    ]
    kv.fork("a", "a2")
    slots = kv.decodes_fit(["a", "a2"], np.array([6, 6]))
    assert slots is not None and slots[0].tolist() == slots[1].tolist() == [False, False]


def test_under_min_rows_the_per_request_path_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below MIN_ROWS running requests the numpy columns cost more than they save."""
    s = _scheduler(64, 64, 8)
    for i in range(3):
        s.add(Request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=8), max_total_tokens=64))
    out = s.schedule()
    s.update_after_step(out.chunks)
    for chunk in out.chunks:
        chunk.request.output_token_ids.append(4)
    finder = PlainDecodeFinder(s.kv_cache)
    assert finder.find(s._in_service_order()) is not None
    monkeypatch.setattr(plain_decodes, "MIN_ROWS", 4)
    assert finder.find(s._in_service_order()) is None


def _at_a_block_boundary(num_blocks: int) -> Scheduler:
    """Two running requests of 4 computed tokens (one full block each), both decoding next,
    in a pool of `num_blocks`."""
    s = _scheduler(64, num_blocks, 8)
    for rid in ("a", "b"):
        s.add(Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=8), max_total_tokens=64))
    out = s.schedule()
    s.update_after_step(out.chunks)
    for chunk in out.chunks:
        chunk.request.output_token_ids.append(5)
    s.kv_cache.take_changed()  # as the engine does every step
    return s


def test_decodes_opening_blocks_get_them_at_once_in_service_order() -> None:
    s = _at_a_block_boundary(num_blocks=8)
    free_before = list(s.kv_cache.pool._free)
    out = s.schedule()
    assert out.decodes_only and not out.preempted
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("a", 4), ("b", 4)]
    # The next free blocks, first to the first in service order: as row by row.
    assert [s.kv_cache.block_table(rid)[1] for rid in ("a", "b")] == free_before[:2]
    assert s.kv_cache.take_changed().appended == {"a", "b"}


def test_a_pool_short_of_blocks_for_the_openings_goes_row_by_row_and_preempts() -> None:
    s = _at_a_block_boundary(num_blocks=3)  # one block free: "b" must give way to "a"
    appended: list[list[str]] = []
    s.kv_cache.append_blocks = appended.append  # type: ignore[method-assign]
    out = s.schedule()
    assert appended == []
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert [r.request_id for r in out.preempted] == ["b"]
