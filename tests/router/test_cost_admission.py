"""Admission by cost (router/admission.py): sequences and KV tokens against the bounds, the
fair turn across tenants and priority within one, a tenant's concurrent-sequence limit, and
every place and token of KV given back on every path."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.router.admission import KV_OVERCOMMIT, AdmissionController, Claim, Cost, Ticket
from kvrelay.router.request_errors import InvalidRequestError, OverloadedError
from kvrelay.router.tenant_limits import TenantLimitError


def idle(admission: AdmissionController) -> bool:
    books = (admission.in_flight, admission.queued, admission.kv_in_use)
    requests = (admission.requests_in_flight, admission.requests_queued)
    return books == (0, 0, 0) and requests == (0, 0) and not admission._by_tenant


async def order_of(tickets: dict[str, Ticket], first: Ticket) -> list[str]:
    """Release `first`, then each ticket as soon as it is granted: the order of the grants."""
    order: list[str] = []

    async def run(name: str) -> None:
        await tickets[name].wait()
        order.append(name)
        await asyncio.sleep(0)
        tickets[name].release()

    tasks = [asyncio.create_task(run(name)) for name in tickets]
    await asyncio.sleep(0)
    first.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return order


async def test_a_request_counts_as_its_sequences() -> None:
    admission = AdmissionController(max_in_flight=6, max_queued=3)
    a = admission.reserve(Cost(3))
    b = admission.reserve(Cost(3))
    assert (admission.in_flight, admission.requests_in_flight) == (6, 2)
    queued = admission.reserve(Cost(3))  # 6 running: it waits
    assert (admission.queued, admission.requests_queued) == (3, 1)
    with pytest.raises(OverloadedError, match="6 sequences running, 3 queued"):
        admission.reserve(Cost(1))  # the queue holds 3 sequences
    a.release()
    await asyncio.wait_for(queued.wait(), 1)
    assert admission.in_flight == 6
    for ticket in (b, queued):
        ticket.release()
    assert idle(admission)


async def test_more_sequences_than_ever_run_is_refused_naming_n() -> None:
    admission = AdmissionController(max_in_flight=4, max_queued=100)
    assert admission.never_fits(Cost(5)) == "sequences"
    assert admission.never_fits(Cost(4)) is None
    with pytest.raises(InvalidRequestError) as refused:
        admission.reserve(Cost(5))
    assert refused.value.param == "n" and "lower n" in refused.value.message
    assert idle(admission)


async def test_kv_tokens_count_against_the_pools_budget() -> None:
    capacity = 1000
    admission = AdmissionController(8, 8, kv_capacity=lambda: capacity)
    assert admission.kv_budget == capacity * KV_OVERCOMMIT
    # Several sequences that could never be held at once: never fits. One sequence is let
    # run whatever it may reach (alone if need be; the engine preempts).
    assert admission.never_fits(Cost(2, 1001)) == "kv"
    assert admission.never_fits(Cost(1, 5000)) is None
    big = [admission.reserve(Cost(2, 1000)) for _ in range(KV_OVERCOMMIT)]
    assert admission.kv_in_use == admission.kv_budget and admission.in_flight == 8
    for ticket in big[1:]:
        ticket.release()
    waiting = admission.reserve(Cost(1, capacity * KV_OVERCOMMIT))  # sequences free, KV not
    assert admission.requests_queued == 1
    big[0].release()  # nothing runs now: it runs, even beyond the budget
    await asyncio.wait_for(waiting.wait(), 1)
    assert admission.kv_in_use == capacity * KV_OVERCOMMIT
    waiting.release()
    assert idle(admission)


async def test_unknown_capacity_does_not_count_kv() -> None:
    admission = AdmissionController(4, 0, kv_capacity=lambda: 0)
    tickets = [admission.reserve(Cost(1, 10**9)) for _ in range(4)]
    assert admission.never_fits(Cost(4, 10**12)) is None
    for ticket in tickets:
        ticket.release()
    assert idle(admission)


async def test_the_next_turn_goes_to_the_tenant_served_least() -> None:
    """Capacity held; A, A, A, B queue; released one at a time: A, B, A, A."""
    admission = AdmissionController(max_in_flight=1, max_queued=10)
    holder = admission.reserve(Cost(1), Claim("H"))
    tickets = {
        "a1": admission.reserve(Cost(1), Claim("A")),
        "a2": admission.reserve(Cost(1), Claim("A")),
        "a3": admission.reserve(Cost(1), Claim("A")),
        "b1": admission.reserve(Cost(1), Claim("B")),
    }
    assert await order_of(tickets, holder) == ["a1", "b1", "a2", "a3"]
    assert idle(admission)


async def test_a_burst_of_one_tenant_does_not_hold_the_queue() -> None:
    """A tenant sends 8 at once (4 run, 4 wait); another's request, arriving after them, is
    the next to run, not the ninth."""
    admission = AdmissionController(max_in_flight=4, max_queued=10)
    running = [admission.reserve(Cost(1), Claim("burst")) for _ in range(4)]
    tickets = {f"burst{i}": admission.reserve(Cost(1), Claim("burst")) for i in range(4)}
    tickets["victim"] = admission.reserve(Cost(1), Claim("victim"))
    order = await order_of(tickets, running[0])
    assert order[0] == "victim" and order[1:] == [f"burst{i}" for i in range(4)]
    for ticket in running[1:]:
        ticket.release()
    assert idle(admission)


async def test_priority_orders_one_tenants_waiting_requests() -> None:
    admission = AdmissionController(max_in_flight=1, max_queued=10)
    holder = admission.reserve()
    tickets = {
        f"p{priority}": admission.reserve(Cost(1), Claim("A", priority=priority))
        for priority in (5, -1, 3, 0)
    }
    assert await order_of(tickets, holder) == ["p-1", "p0", "p3", "p5"]
    assert idle(admission)


async def test_the_fairest_head_is_not_skipped_for_a_smaller_request() -> None:
    admission = AdmissionController(max_in_flight=4, max_queued=10)
    small = admission.reserve(Cost(2), Claim("B"))
    rest = admission.reserve(Cost(2), Claim("B"))
    big = admission.reserve(Cost(4), Claim("A"))  # A has had nothing: its turn is next
    tiny = admission.reserve(Cost(1), Claim("B"))
    small.release()  # 2 free: tiny would fit, but A's request is the head
    assert not big.granted and not tiny.granted
    rest.release()
    assert big.granted and not tiny.granted
    big.release()
    assert tiny.granted
    tiny.release()
    assert idle(admission)


async def test_a_tenants_concurrent_sequences_are_limited() -> None:
    admission = AdmissionController(max_in_flight=2, max_queued=10, retry_after_s=2)
    claim = Claim("A", max_sequences=3)
    running = admission.reserve(Cost(2), claim)
    queued = admission.reserve(Cost(1), claim)  # running + queued count
    with pytest.raises(TenantLimitError) as refused:
        admission.reserve(Cost(1), claim)
    assert refused.value.limit == "max_concurrent_sequences" and refused.value.tenant == "A"
    assert refused.value.retry_after_s == 2
    other = admission.reserve(Cost(1), Claim("B", max_sequences=3))  # another tenant's own
    assert admission.tenant_sequences("A") == 3
    running.release()
    admission.reserve(Cost(1), claim).release()  # a place of A's is free again
    for ticket in (queued, other):
        ticket.release()
    assert idle(admission)


async def test_every_path_gives_back_what_it_held() -> None:
    admission = AdmissionController(2, 4, kv_capacity=lambda: 100)
    running = admission.reserve(Cost(2, 50), Claim("A"))
    queued = admission.reserve(Cost(1, 10), Claim("B"))
    waiter = asyncio.create_task(queued.wait())
    await asyncio.sleep(0)
    waiter.cancel()  # the client left while queued: its place stays until released
    assert admission.requests_queued == 1
    queued.release()
    queued.release()  # exactly once: the second is a no-op
    assert (admission.queued, admission.tenant_sequences("B")) == (0, 0)
    handed = admission.reserve(Cost(1, 10), Claim("B"))
    running.release()  # handed its slot; it never runs (its request failed before `wait`)
    assert handed.granted and admission.kv_in_use == 10
    handed.release()
    assert idle(admission)
    full = AdmissionController(1, 0)
    held = full.reserve(Cost(1), Claim("A"))
    with pytest.raises(OverloadedError):
        full.reserve(Cost(1), Claim("A"))  # refused: nothing counted for it
    assert full.tenant_sequences("A") == 1
    held.release()
    assert idle(full)
    with pytest.raises(InvalidRequestError):
        admission.reserve(Cost(3))  # never fits: nothing counted either
    assert idle(admission)


async def test_a_newcomer_that_is_the_fairest_head_runs_at_once() -> None:
    admission = AdmissionController(max_in_flight=3, max_queued=10)
    first = admission.reserve(Cost(2), Claim("A"))
    big = admission.reserve(Cost(2), Claim("A"))  # waits: 1 free
    newcomer = admission.reserve(Cost(1), Claim("B"))  # B has had nothing and fits
    assert newcomer.granted and not big.granted
    for ticket in (first, big, newcomer):
        ticket.release()
    assert idle(admission)
