"""Admission: the bound on running requests, the bounded queue, refusal beyond both, and no
slot lost on any path (used, never used, cancelled while queued)."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.router.admission import AdmissionController
from kvrelay.router.request_errors import OverloadedError, UnavailableError


async def test_runs_queues_then_refuses() -> None:
    admission = AdmissionController(max_in_flight=2, max_queued=1, retry_after_s=3)
    a, b = admission.reserve(), admission.reserve()
    queued = admission.reserve()
    assert (admission.in_flight, admission.queued) == (2, 1)
    with pytest.raises(OverloadedError) as refused:
        admission.reserve()
    assert refused.value.retry_after_s == 3 and "capacity" in refused.value.message
    waiting = asyncio.create_task(queued.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    a.release()
    await asyncio.wait_for(waiting, 1)  # the freed slot passed to the queued request
    assert (admission.in_flight, admission.queued) == (2, 0)
    for ticket in (b, queued, queued):  # a second release is a no-op
        ticket.release()
    assert (admission.in_flight, admission.queued) == (0, 0)


async def test_queue_is_first_come_first_served() -> None:
    admission = AdmissionController(max_in_flight=1, max_queued=3)
    running = admission.reserve()
    tickets = [admission.reserve() for _ in range(3)]
    order: list[int] = []

    async def run(i: int) -> None:
        await tickets[i].wait()
        order.append(i)
        tickets[i].release()

    tasks = [asyncio.create_task(run(i)) for i in (2, 0, 1)]
    await asyncio.sleep(0)
    running.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (admission.in_flight, admission.queued) == (0, 0)


async def test_a_queued_ticket_released_unused_gives_its_place_back() -> None:
    admission = AdmissionController(max_in_flight=1, max_queued=1)
    running = admission.reserve()
    queued = admission.reserve()
    waiter = asyncio.create_task(queued.wait())
    await asyncio.sleep(0)
    waiter.cancel()  # the client left while queued
    queued.release()
    assert admission.queued == 0
    admission.reserve().release()  # the queue place is free again
    running.release()
    assert admission.in_flight == 0


async def test_granted_but_never_awaited_still_frees_the_slot() -> None:
    admission = AdmissionController(max_in_flight=1, max_queued=1)
    running = admission.reserve()
    queued = admission.reserve()
    running.release()  # hands the slot to `queued`, which never runs
    assert admission.in_flight == 1
    queued.release()
    assert admission.in_flight == 0


async def test_slot_context_and_closing() -> None:
    admission = AdmissionController(max_in_flight=1, max_queued=0)
    async with admission.slot():
        assert admission.in_flight == 1
        with pytest.raises(OverloadedError):
            admission.reserve()
    assert admission.in_flight == 0
    admission.close()
    with pytest.raises(UnavailableError, match="shutting down"):
        admission.reserve()


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        AdmissionController(0, 1)
