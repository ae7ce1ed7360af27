"""Scheduler: token budget, chunked prefill, decodes first, admission order, preemption."""

from __future__ import annotations

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import SchedulerConfig
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduled import SchedulerOutput
from kvrelay.engine.scheduler import Scheduler


def make_request(rid: str, prompt_len: int, *, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_tokens=100),
        max_total_tokens=10_000,
        priority=priority,
        arrival_time=arrival,
    )


def make_scheduler(budget: int = 64, num_blocks: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        KVCacheManager(num_blocks=num_blocks, block_size=4),
    )


def run_step(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward pass: commit the KV and append sampled tokens."""
    s.update_after_step(out.chunks)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.output_token_ids.append(7)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_long_prompt_is_chunked_across_steps() -> None:
    s = make_scheduler(budget=16)
    s.add(make_request("a", 40))
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append(plan(out))
        run_step(s, out)
    assert steps == [[("a", 0, 16)], [("a", 16, 16)], [("a", 32, 8)]]
    assert s.running[0].output_token_ids == [7]  # only the last chunk samples


def test_running_decodes_are_served_before_prefill_chunks() -> None:
    s = make_scheduler(budget=10)
    s.add(make_request("old", 30, arrival=0))
    s.add(make_request("new", 3, arrival=1))
    out = s.schedule()
    assert plan(out) == [("old", 0, 10)]
    run_step(s, out)
    out = s.schedule()  # "old" keeps prefilling; "new" is admitted with what is left
    assert plan(out) == [("old", 10, 10)]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("old", 20, 10)]
    run_step(s, out)
    s.add(make_request("late", 25, arrival=2))
    out = s.schedule()
    # "old" now decodes one token and goes first; "new" prefills, then "late" gets the rest.
    assert plan(out) == [("old", 30, 1), ("new", 0, 3), ("late", 0, 6)]


def test_decode_comes_before_an_older_requests_prefill_chunk() -> None:
    s = make_scheduler(budget=8)
    s.add(make_request("a", 20, arrival=0))
    s.add(make_request("b", 2, arrival=1))
    out = s.schedule()
    assert plan(out) == [("a", 0, 8)]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 8, 8)]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 16, 4), ("b", 0, 2)]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 20, 1), ("b", 2, 1)]


def test_priority_then_arrival_decides_admission() -> None:
    s = make_scheduler(budget=4, max_seqs=1)
    s.add(make_request("first", 4, arrival=0))
    s.add(make_request("urgent", 4, priority=-1, arrival=1))
    assert plan(s.schedule()) == [("urgent", 0, 4)]


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = make_scheduler(budget=64, max_seqs=2)
    for i in range(3):
        s.add(make_request(f"r{i}", 4, arrival=i))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_evicts_the_newest_and_resumes_it_by_recompute() -> None:
    # 4 blocks of 4 tokens: two requests of 8 prompt tokens fill the pool.
    s = make_scheduler(budget=64, num_blocks=4)
    s.add(make_request("old", 8, arrival=0))
    s.add(make_request("new", 8, arrival=1))
    out = s.schedule()
    assert plan(out) == [("old", 0, 8), ("new", 0, 8)]
    run_step(s, out)
    # Both need a third block for their next token: the newest is preempted.
    out = s.schedule()
    assert plan(out) == [("old", 8, 1)]
    [victim] = out.preempted
    assert victim.request_id == "new"
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.output_token_ids == [7]  # its output is kept
    run_step(s, out)
    # When "old" finishes, "new" recomputes prompt + output (9 tokens) and samples again.
    s.finish(s.running[0], RequestStatus.FINISHED_LENGTH)
    out = s.schedule()
    assert plan(out) == [("new", 0, 9)]
    assert out.chunks[0].samples


def test_finish_frees_blocks() -> None:
    s = make_scheduler()
    r = make_request("a", 10)
    s.add(r)
    run_step(s, s.schedule())
    assert s.kv_cache.num_free_blocks < 64
    s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.pool.is_whole()
    assert s.num_unfinished == 0


# --- requests waiting for remote KV (decode role) --------------------------------------------


def remote_request(s: Scheduler, rid: str = "p", prompt_len: int = 10) -> Request:
    """A prefilled request as the decode engine holds it: the prefill's first token appended,
    the prompt's blocks allocated, its KV not yet pulled."""
    request = make_request(rid, prompt_len)
    request.output_token_ids.append(7)
    assert s.kv_cache.allocate_slots(rid, prompt_len)
    s.add_waiting_for_remote_kv(request)
    return request


def test_a_request_waiting_for_remote_kv_is_never_scheduled() -> None:
    s = make_scheduler()
    request = remote_request(s)
    s.add(make_request("local", 5))
    for _ in range(3):
        out = s.schedule()
        assert all(c.request is not request for c in out.chunks)
        assert request not in s.waiting and request not in s.running
        run_step(s, out)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.waiting_for_remote_kv == {"p": request}
    assert s.num_unfinished == 2
    assert s.kv_cache.block_table("p") != []  # its blocks stay allocated meanwhile


def test_landed_remote_kv_joins_the_batch_decoding() -> None:
    s = make_scheduler()
    request = remote_request(s)
    s.finish_remote_kv(request, ok=True)
    assert request.status == RequestStatus.RUNNING and s.running == [request]
    assert not s.waiting_for_remote_kv
    assert request.num_computed_tokens == 10
    assert plan(s.schedule()) == [("p", 10, 1)]  # a decode step: the prompt is not recomputed


def test_failed_remote_kv_recomputes_from_scratch() -> None:
    s = make_scheduler()
    request = remote_request(s)
    s.finish_remote_kv(request, ok=False)
    assert s.kv_cache.pool.is_whole()  # its blocks were freed
    assert request.status == RequestStatus.WAITING and s.waiting == [request]
    assert request.num_computed_tokens == 0
    assert plan(s.schedule()) == [("p", 0, 11)]  # prompt + the first token


def test_finish_while_waiting_for_remote_kv_frees_its_blocks() -> None:
    s = make_scheduler()
    request = remote_request(s)
    assert not s.kv_cache.pool.is_whole()
    s.finish(request, RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert not s.waiting_for_remote_kv and s.num_unfinished == 0
    assert s.kv_cache.pool.is_whole()


def test_landed_remote_kv_waits_for_a_seat_keeping_its_blocks() -> None:
    """A full batch (max_num_seqs) is full for a prefill engine's requests too: one whose KV
    lands then waits, its blocks kept (no recompute), and decodes when a seat frees."""
    s = make_scheduler(max_seqs=1)
    local = make_request("local", 5)
    s.add(local)
    run_step(s, s.schedule())
    request = remote_request(s)
    s.finish_remote_kv(request, ok=True)
    assert s.running == [local] and s.waiting == [request]
    assert request.status == RequestStatus.WAITING
    table = s.kv_cache.block_table("p")
    for _ in range(3):
        out = s.schedule()
        assert plan(out) == [
            ("local", len(local.prompt_token_ids) + len(local.output_token_ids) - 1, 1)
        ]
        run_step(s, out)
    assert s.kv_cache.block_table("p") == table  # held, not freed meanwhile
    s.finish(local, RequestStatus.FINISHED_STOPPED)
    assert plan(s.schedule()) == [("p", 10, 1)]  # its first decode: the prompt not recomputed
    assert s.running == [request] and not s.waiting
    s.finish(request, RequestStatus.FINISHED_STOPPED)
    assert s.kv_cache.pool.is_whole()


def test_aborting_a_landed_request_waiting_for_a_seat_frees_its_blocks() -> None:
    s = make_scheduler(max_seqs=1)
    s.add(make_request("local", 5))
    run_step(s, s.schedule())
    request = remote_request(s)
    s.finish_remote_kv(request, ok=True)
    s.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not s.waiting and s.num_unfinished == 1
    s.finish(s.running[0], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.pool.is_whole()


# --- pure decode steps (what the runner builds from its persistent batch) ---------------------


def test_a_step_of_only_decodes_says_so() -> None:
    """`decodes_only`: every chunk one sampling token without forks, whether or not it needed
    a new block; a prefill chunk in the step, or a leader with forks, makes it False."""
    s = make_scheduler(budget=64)
    s.add(make_request("a", 3, arrival=0))
    s.add(make_request("b", 4, arrival=1))
    out = s.schedule()
    assert plan(out) == [("a", 0, 3), ("b", 0, 4)] and not out.decodes_only
    run_step(s, out)
    out = s.schedule()  # a's token fits its block; b's needs a second block
    assert plan(out) == [("a", 3, 1), ("b", 4, 1)] and out.decodes_only
    run_step(s, out)
    s.add(make_request("c", 5, arrival=2))
    out = s.schedule()
    assert plan(out) == [("a", 4, 1), ("b", 5, 1), ("c", 0, 5)] and not out.decodes_only
    run_step(s, out)
    forked = make_request("d", 1, arrival=3)
    s.add(forked, forks=[make_request("d-1", 1, arrival=3)])
    out = s.schedule()  # d's one-token prompt samples, and its fork joins: not plain
    assert out.chunks[-1].forks and not out.decodes_only
    run_step(s, out)
    assert s.schedule().decodes_only  # a, b, c, d and d-1 decode


def test_decodes_only_counts_again_after_a_preemption() -> None:
    """A victim already scheduled is taken out of the step: what is left still decodes."""
    s = make_scheduler(budget=64, num_blocks=5)
    s.add(make_request("old", 8, arrival=0))
    s.add(make_request("new", 8, arrival=1))
    run_step(s, s.schedule())
    out = s.schedule()  # both need a third block; 5 blocks hold one more: new is preempted
    assert plan(out) == [("old", 8, 1)] and [r.request_id for r in out.preempted] == ["new"]
    assert out.decodes_only


def test_the_service_order_is_kept_until_the_running_set_changes() -> None:
    """The sorted order is reused while `running` holds the same requests; a request that
    joins (or leaves) is placed by priority, then arrival, at once."""
    s = make_scheduler(budget=64)
    for rid, arrival in (("b", 1.0), ("a", 0.0)):
        s.add(make_request(rid, 2, arrival=arrival))
    run_step(s, s.schedule())
    order = s._in_service_order()
    assert [r.request_id for r in order] == ["a", "b"] and s._in_service_order() is order
    s.add(make_request("urgent", 2, priority=-1, arrival=5.0))
    run_step(s, s.schedule())
    assert [c.request.request_id for c in s.schedule().chunks] == ["urgent", "a", "b"]
    [a] = [r for r in s.running if r.request_id == "a"]
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in s._in_service_order()] == ["urgent", "b"]


def test_decode_fits_answers_as_allocate_slots_would() -> None:
    """`decode_fits` is True exactly when `allocate_slots` for the next token would change
    nothing (no block to add, no shared block to copy); `take_changed` names every table
    an allocation, a fork or a free changed, and no table a fitting decode left alone."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert not kv.decode_fits("x", 0)  # no table yet
    assert kv.allocate_slots("x", 6)
    assert kv.take_changed().changed == {"x"}
    assert kv.decode_fits("x", 6) and kv.decode_fits("x", 7)
    assert not kv.decode_fits("x", 8)  # a third block is needed
    assert kv.allocate_slots("x", 7, num_computed_tokens=6)  # fits: nothing changes
    assert kv.take_changed().changed == set()
    kv.fork("x", "y")  # y shares x's partial last block: neither may write it in place
    assert kv.take_changed().changed == {"y"}
    assert not kv.decode_fits("x", 6) and not kv.decode_fits("y", 6)
    assert kv.allocate_slots("y", 7, num_computed_tokens=6)  # copy-on-write
    assert kv.take_copies() and kv.take_changed().changed == {"y"}
    assert kv.decode_fits("x", 6) and kv.decode_fits("y", 6)
    assert kv.allocate_slots("x", 20, num_computed_tokens=6)  # blocks ahead of the token
    assert kv.decode_fits("x", 8) and kv.decode_fits("x", 12)
    kv.free("x")
    assert kv.take_changed().changed == {"x"} and not kv.decode_fits("x", 6)
    kv.free("x")  # already freed: nothing changed
    assert kv.take_changed().changed == set()


def test_a_table_one_block_longer_is_told_apart_from_other_changes() -> None:
    """`append_blocks` (a decode opening a block) is `take_changed`'s `appended`: the
    runner writes that one block. Appended twice, or changed otherwise as well, it is among
    `changed` only (its row compared and rewritten)."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    for rid in ("a", "b", "c"):
        assert kv.allocate_slots(rid, 4)
    kv.take_changed()
    kv.append_blocks(["a", "b"])
    assert kv.take_changed() == (set(), {"a", "b"})
    kv.append_blocks(["a"])
    kv.append_blocks(["a", "b"])
    assert kv.allocate_slots("b", 16, num_computed_tokens=12)  # grown again, row by row
    kv.append_blocks(["c"])
    assert kv.take_changed() == ({"a", "b"}, {"c"})
    assert [len(kv.block_table(rid)) for rid in ("a", "b", "c")] == [4, 4, 2]
