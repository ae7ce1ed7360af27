"""The scheduler across tenants (engine/fair_share.py): who is admitted next, whose request is
preempted, when a waiting request takes a running one's place, and that nobody is preempted
back and forth. Real Scheduler and KV cache manager; the engine's step is played by `drive`."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from kvrelay.common.messages import EngineRequest
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import SchedulerConfig
from kvrelay.engine import fair_share
from kvrelay.engine.fair_share import Shares
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduled import SchedulerOutput
from kvrelay.engine.scheduler import Scheduler

_arrivals = itertools.count()


def req(
    rid: str,
    tenant: str = "",
    *,
    prompt: int = 4,
    weight: float = 1.0,
    priority: int = 0,
    max_tokens: int = 100,
) -> Request:
    """A request of `tenant`; arrival order is creation order."""
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        max_total_tokens=10_000,
        priority=priority,
        arrival_time=float(next(_arrivals)),
        tenant=tenant,
        weight=weight,
    )


def sched(max_seqs: int = 4, num_blocks: int = 256, budget: int = 256, **kw: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw),
        KVCacheManager(num_blocks=num_blocks, block_size=4),
    )


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, commit the KV, append a token to each sampling chunk, and
    finish those that reached max_tokens (as the engine does)."""
    out = s.schedule()
    s.update_after_step(out.chunks)
    for chunk in out.chunks:
        for request in (chunk.request, *chunk.forks) if chunk.samples else ():
            request.output_token_ids.append(7)
            if len(request.output_token_ids) >= (request.sampling_params.max_tokens or 0):
                s.finish(request, RequestStatus.FINISHED_LENGTH)
    return out


def running(s: Scheduler) -> Counter[str]:
    return Counter(r.tenant for r in s.running)


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def flood(s: Scheduler, tenant: str, count: int, **kw: float) -> list[Request]:
    requests = [req(f"{tenant}{i}", tenant, **kw) for i in range(count)]  # type: ignore[arg-type]
    for r in requests:
        s.add(r)
    return requests


def assert_all_freed(s: Scheduler) -> None:
    """Abort whatever is left (a leader's orphaned forks are queued when it ends) and check
    that every KV block came back."""
    while s.running or s.waiting:
        s.finish([*s.running, *s.waiting][0], RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0
    assert s.kv_cache.num_free_blocks == s.kv_cache.pool.num_blocks
    assert s.kv_cache.pool.is_whole()


# --- admission -------------------------------------------------------------------------------


def test_a_late_tenant_is_admitted_before_the_flooding_tenants_later_requests() -> None:
    s = sched(max_seqs=4)
    flood(s, "A", 6)
    s.add(req("B0", "B"))  # arrives after all of A's
    out = step(s)
    # Least running / weight first: A0, then B0 (0 running against A's 1), then A1, A2.
    assert [c.request.request_id for c in out.chunks] == ["A0", "B0", "A1", "A2"]
    assert ids(s.waiting) == ["A3", "A4", "A5"] and not out.preempted
    assert_all_freed(s)


def test_one_tenant_is_admitted_in_priority_then_arrival_order() -> None:
    s = sched(max_seqs=3)
    for name, priority in (("late", 0), ("urgent", -1), ("later", 0), ("low", 5)):
        s.add(req(name, "T", priority=priority))
    assert [c.request.request_id for c in step(s).chunks] == ["urgent", "late", "later"]
    assert_all_freed(s)


def test_weights_two_to_one_give_a_two_to_one_split_that_stays() -> None:
    s = sched(max_seqs=6)
    flood(s, "A", 12, weight=2.0)
    flood(s, "B", 12, weight=1.0)
    for _ in range(30):  # requests finish (max_tokens 10) and others take their seats
        step(s)
        assert running(s) == {"A": 4, "B": 2}
    assert s.num_preemptions == 0
    assert_all_freed(s)


def test_a_tenant_arriving_at_a_full_batch_takes_seats_up_to_its_share() -> None:
    """A fills all 6 seats; B (weight 1 against A's 2) floods: A's newest requests are
    preempted until the split is 4:2, then nobody moves."""
    s = sched(max_seqs=6)
    flood(s, "A", 10, weight=2.0)
    step(s)
    assert running(s) == {"A": 6}
    flood(s, "B", 10)
    out = step(s)
    assert ids(out.preempted) == ["A5", "A4"]  # the newest first
    assert running(s) == {"A": 4, "B": 2}
    for _ in range(20):
        assert not step(s).preempted
    assert_all_freed(s)


def test_a_request_landed_from_a_prefill_engine_takes_a_seat_by_share() -> None:
    """A decode engine's full batch: B's request, whose KV was pulled from a prefill engine,
    waits holding its blocks and takes the seat of A's newest (A over its share), decoding
    at once without recomputing its prompt."""
    s = sched(max_seqs=4)
    flood(s, "A", 6)
    step(s)
    assert running(s) == {"A": 4}
    landed = req("B0", "B", prompt=8)
    landed.output_token_ids.append(7)  # the prefill engine's first token
    assert s.kv_cache.allocate_slots("B0", 8)
    s.add_waiting_for_remote_kv(landed)
    s.finish_remote_kv(landed, ok=True)
    assert landed in s.waiting  # the batch is full
    out = step(s)
    assert ids(out.preempted) == ["A3"]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks][-1] == ("B0", 8, 1)
    assert running(s) == {"A": 3, "B": 1}
    assert_all_freed(s)


# --- preemption --------------------------------------------------------------------------------


def kv_pressure(tenants: dict[str, str]) -> tuple[Scheduler, SchedulerOutput]:
    """Four requests of 8 prompt tokens (two blocks each) take 8 of 10 blocks, then each
    needs a third block: the first two get the free ones, the third finds none, so one must
    go (and its two blocks cover the rest). `tenants`: each request's tenant, in arrival
    order."""
    s = sched(max_seqs=8, num_blocks=10)
    for rid, tenant in tenants.items():
        s.add(req(rid, tenant, prompt=8))
    step(s)
    assert len(s.running) == 4 and s.kv_cache.num_free_blocks == 2
    return s, step(s)


def test_kv_pressure_preempts_the_newest_of_the_tenant_over_its_share() -> None:
    s, out = kv_pressure({"a0": "A", "a1": "A", "a2": "A", "b0": "B"})
    # b0 is the newest, but A holds 3 of 4 sequences: its newest goes.
    assert ids(out.preempted) == ["a2"]
    assert out.preempted[0].status is RequestStatus.PREEMPTED
    assert_all_freed(s)


def test_kv_pressure_with_one_tenant_preempts_exactly_the_newest() -> None:
    s, out = kv_pressure({"a0": "A", "a1": "A", "a2": "A", "a3": "A"})
    assert ids(out.preempted) == ["a3"]
    assert_all_freed(s)


def test_kv_pressure_at_equal_shares_preempts_the_newest_overall() -> None:
    s, out = kv_pressure({"a0": "A", "b0": "B", "a1": "A", "b1": "B"})
    assert ids(out.preempted) == ["b1"]
    assert_all_freed(s)


def test_the_victim_is_the_lowest_priority_request_of_the_over_share_tenant() -> None:
    running = [
        req("a-low", "A", priority=3),
        req("a-new", "A"),
        req("a-x", "A"),
        req("b-worst", "B", priority=9),
    ]
    assert fair_share.preemption_victim(running, {}).request_id == "a-low"
    one = [req("x", priority=1), req("y"), req("z", priority=1)]  # one tenant: as before
    assert fair_share.preemption_victim(one, {}) is max(one, key=lambda r: r.scheduling_key)


def test_a_waiting_request_of_better_priority_takes_its_own_tenants_worst_seat() -> None:
    s = sched(max_seqs=3)
    flood(s, "A", 3)
    step(s)
    s.add(req("same", "A"))
    assert not step(s).preempted  # equal priority: it waits its turn
    s.add(req("urgent", "A", priority=-1))
    out = step(s)
    assert ids(out.preempted) == ["A2"]
    assert "urgent" in ids(s.running) and ids(s.waiting) == ["same", "A2"]
    assert_all_freed(s)


def test_priority_never_takes_a_seat_from_another_tenant_at_its_share() -> None:
    s = sched(max_seqs=4)
    flood(s, "A", 2)
    flood(s, "B", 2)
    step(s)
    assert running(s) == {"A": 2, "B": 2}
    s.add(req("b-urgent", "B", priority=-5))  # B's own worst goes, never one of A's
    out = step(s)
    assert ids(out.preempted) == ["B1"] and running(s) == {"A": 2, "B": 2}
    s.add(req("b-meh", "B"))  # no better than B's worst running, and B is at its share
    assert not step(s).preempted and ids(s.waiting) == ["B1", "b-meh"]
    assert_all_freed(s)


def test_a_waiting_request_short_of_kv_takes_kv_from_the_tenant_over_its_share() -> None:
    """The batch has seats, but KV is full: B's request takes A's newest request's blocks."""
    s = sched(max_seqs=8, num_blocks=8)
    for i in range(4):
        s.add(req(f"a{i}", "A", prompt=7))
    step(s)
    assert s.kv_cache.num_free_blocks == 0
    s.add(req("b0", "B", prompt=4))
    # A's decodes fit their blocks (the 8th token of two blocks of 4); b0 needs a block.
    out = step(s)
    assert [c.request.request_id for c in out.chunks] == ["a0", "a1", "a2", "b0"]
    assert ids(out.preempted) == ["a3"] and ids(s.waiting) == ["a3"]
    assert_all_freed(s)


# --- no ping-pong --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_seqs", [4, 5])
def test_equal_share_tenants_never_preempt_each_other_back_and_forth(max_seqs: int) -> None:
    s = sched(max_seqs=max_seqs, num_blocks=256)
    flood(s, "A", 20, max_tokens=7)
    flood(s, "B", 20, max_tokens=11)
    for _ in range(200):
        step(s)
        counts = running(s)
        if (
            s.waiting
            and len(s.running) == max_seqs
            and {r.tenant for r in s.waiting}
            == {
                "A",
                "B",
            }
        ):
            assert abs(counts["A"] - counts["B"]) <= 1  # shared evenly while both wait
    assert s.num_preemptions == 0
    assert_all_freed(s)


def test_under_kv_pressure_no_request_is_preempted_back_and_forth() -> None:
    """Two tenants' long requests outgrow a small pool: preemptions happen, but each one moves
    KV towards the tenant under its share; nobody is preempted in two steps running."""
    s = sched(max_seqs=8, num_blocks=24)
    flood(s, "A", 6, prompt=6, max_tokens=30)
    flood(s, "B", 6, prompt=6, max_tokens=30)
    last: set[str] = set()
    for _ in range(400):
        if not s.num_unfinished:
            break
        out = step(s)
        now = set(ids(out.preempted))
        assert not now & last, f"preempted again at once: {now & last}"
        last = now
    assert not s.num_unfinished, "the workload did not finish"
    assert_all_freed(s)


def test_the_share_rule_never_allows_the_reverse_move() -> None:
    """For every pair of loads and weights: if u may take v's seat, v may not take u's after."""
    for su, sv, wu, wv in itertools.product(range(6), range(1, 7), (1.0, 2.0, 3.0), (1.0, 2.0)):
        shares = Shares([], {})
        shares.sequences, shares.weights = Counter({"u": su, "v": sv}), {"u": wu, "v": wv}
        u_new, v_run = req("u-new", "u", weight=wu), req("v-run", "v", weight=wv)
        running = [v_run] + [req(f"u{i}", "u", weight=wu) for i in range(su)]
        if fair_share.victim_for(u_new, running, shares) is not v_run:
            continue
        shares.sequences = Counter({"u": su + 1, "v": sv - 1})  # the move
        back = fair_share.victim_for(req("v-back", "v", weight=wv), running, shares)
        assert back is None or back.tenant == "v", (su, sv, wu, wv)


# --- forks ---------------------------------------------------------------------------------------


def test_forks_count_as_sequences_of_their_tenant() -> None:
    """A's leader with 3 forks still prefilling counts as 4 sequences: with one seat left, B
    (2 running) is admitted before A (1 running request, 4 sequences)."""
    s = sched(max_seqs=4, long_prefill_token_threshold=16)
    s.add(req("b1", "B", prompt=2))
    s.add(req("b2", "B", prompt=2))
    leader = req("a", "A", prompt=120)
    s.add(leader, forks=[req(f"a#{i}", "A", prompt=120) for i in (1, 2, 3)])
    step(s)
    assert sorted(ids(s.running)) == ["a", "b1", "b2"] and leader.num_computed_tokens == 16
    assert fair_share.num_sequences(leader, s._forks) == 4
    s.add(req("a-x", "A"))
    s.add(req("b-y", "B"))
    out = step(s)
    assert "b-y" in ids([c.request for c in out.chunks]) and ids(s.waiting) == ["a-x"]
    while leader.num_computed_tokens < 120:
        step(s)
    assert running(s)["A"] == 4  # the forks joined at the leader's first token
    assert_all_freed(s)


def test_a_preempted_leader_keeps_its_forks_for_its_return() -> None:
    s = sched(max_seqs=2, long_prefill_token_threshold=8)
    s.add(req("b0", "B", prompt=2))
    leader = req("a", "A", prompt=40)
    s.add(leader, forks=[req("a#1", "A", prompt=40)])
    step(s)
    s.add(req("b1", "B", prompt=2))
    # B: 1 running; A: 2 sequences (leader + pending fork). (1 + 1) <= 2 - 2 fails: no move.
    assert not step(s).preempted
    assert_all_freed(s)


# --- the tenant on the wire ------------------------------------------------------------------


@pytest.mark.parametrize("weight", [0.0, -1.0, math.nan, math.inf])
def test_an_engine_request_refuses_a_weight_that_is_not_positive(weight: float) -> None:
    with pytest.raises(ValueError, match=r"weight must be a finite number > 0.*'team-a'"):
        EngineRequest("r", [1, 2], SamplingParams(), tenant="team-a", weight=weight)


def test_an_engine_request_keeps_its_tenant_through_a_replace() -> None:
    """The relay rebuilds a request with dataclasses.replace for a decode worker or a resume."""
    import dataclasses

    request = EngineRequest("r", [1, 2], SamplingParams(), tenant="team-a", weight=2)
    resumed = dataclasses.replace(request, resume_output_token_ids=(5,))
    assert (resumed.tenant, resumed.weight) == ("team-a", 2.0)
    assert EngineRequest("r", [1], SamplingParams()).tenant == ""


# --- cost: a full batch nothing leaves is not counted again ------------------------------------


def test_a_full_batch_that_nothing_leaves_is_not_recounted_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once no waiting request can take a seat, the tenants are counted again only when the
    waiting or running requests change: a new tenant's request is then seated at once."""
    counted: list[int] = []

    class CountedShares(Shares):
        def __init__(self, *args: object, **kwargs: object) -> None:
            counted.append(1)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("kvrelay.engine.scheduler.Shares", CountedShares)
    s = sched(max_seqs=4)
    flood(s, "A", 2)
    flood(s, "B", 4)  # fair admission: A0, B0, A1, B1; then B2 waits, stuck at 2:2
    step(s)
    assert running(s) == {"A": 2, "B": 2} and len(counted) == 1
    for _ in range(10):
        assert not step(s).preempted
    assert len(counted) == 1  # the same waiting and running requests: the same answer
    s.add(req("C0", "C"))
    out = step(s)
    assert len(counted) == 2 and "C0" in ids([c.request for c in out.chunks])
    assert len(out.preempted) == 1  # one of A's or B's two (both level: the newest)
    assert_all_freed(s)
