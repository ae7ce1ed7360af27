"""The fair queue alone (router/fair_queue.py): the tenant with the least weighted service goes
next, idle time banks no credit, priority then arrival within a tenant, withdrawn entries
never come out, and the table forgets idle tenants."""

from __future__ import annotations

import pytest

from kvrelay.router.fair_queue import FairQueue


def drain(queue: FairQueue[str]) -> list[str]:
    out = []
    while (entry := queue.peek()) is not None:
        queue.pop(entry)
        out.append(entry.item)
    assert len(queue) == 0
    return out


def test_tenants_alternate_rather_than_first_come_first_served() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        queue.push(item, "A", 0, 1, 1.0)
    queue.push("b1", "B", 0, 1, 1.0)
    queue.push("b2", "B", 0, 1, 1.0)
    assert len(queue) == 5
    assert drain(queue) == ["a1", "b1", "a2", "b2", "a3"]


def test_service_is_counted_by_cost_and_divided_by_weight() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("big", "A", 0, 4, 1.0)  # one request of 4 sequences
    for i in range(4):
        queue.push(f"b{i}", "B", 0, 1, 1.0)
    # A's one request costs what four of B's do: B catches up before A goes again.
    queue.push("a2", "A", 0, 1, 1.0)
    assert drain(queue) == ["big", "b0", "b1", "b2", "b3", "a2"]

    heavy: FairQueue[str] = FairQueue()
    for i in range(4):
        heavy.push(f"h{i}", "H", 0, 1, 3.0)  # weight 3: three grants for each of L's
        heavy.push(f"l{i}", "L", 0, 1, 1.0)
    # Tied at 1 after h2, the earlier arrival (l1) goes first; H then has its third.
    assert drain(heavy) == ["h0", "l0", "h1", "h2", "l1", "h3", "l2", "l3"]


def test_a_tenant_gets_no_credit_for_the_time_it_was_idle() -> None:
    queue: FairQueue[str] = FairQueue()
    for _ in range(10):
        queue.charge("busy", 1, 1.0)  # ran alone for a while, nobody waiting
    assert queue.vtime("busy") == 10
    queue.push("late1", "late", 0, 1, 1.0)
    queue.push("late2", "late", 0, 1, 1.0)
    queue.push("busy1", "busy", 0, 1, 1.0)
    # `late` starts at the clock (9, the last grant's start), not at 0: it is one grant
    # behind `busy`, not ten, so a third request of its own would wait for busy1.
    assert queue.vtime("late") == 9
    queue.push("late3", "late", 0, 1, 1.0)
    assert drain(queue) == ["late1", "late2", "busy1", "late3"]


def test_priority_then_arrival_within_a_tenant() -> None:
    queue: FairQueue[str] = FairQueue()
    for item, priority in (("p5", 5), ("p1", 1), ("p1-later", 1), ("p-3", -3), ("p0", 0)):
        queue.push(item, "A", priority, 1, 1.0)
    assert drain(queue) == ["p-3", "p0", "p1", "p1-later", "p5"]


def test_priority_does_not_cross_tenants() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a-low", "A", 10, 1, 1.0)
    queue.push("a-high", "A", -10, 1, 1.0)
    queue.push("b", "B", 100, 1, 1.0)  # a low priority in B still gets B's share
    assert drain(queue) == ["a-high", "b", "a-low"]


def test_removed_entries_never_come_out_and_free_the_tenant() -> None:
    queue: FairQueue[str] = FairQueue()
    gone = queue.push("gone", "A", 0, 1, 1.0)
    kept = queue.push("kept", "A", 1, 1, 1.0)
    queue.push("b", "B", 0, 1, 1.0)
    queue.remove(gone)
    queue.remove(gone)  # a second removal is a no-op
    assert len(queue) == 2
    assert queue.peek() is kept  # A's head is now `kept`, and A still has the least
    queue.remove(kept)
    assert drain(queue) == ["b"]
    queue.forget("A")
    assert queue.vtime("A") == 0  # nothing waits: forgotten


def test_forget_keeps_a_waiting_tenant() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.charge("A", 3, 1.0)
    queue.push("a", "A", 0, 1, 1.0)
    queue.forget("A")
    assert queue.vtime("A") == 3  # it waits: its service still counts


def test_pop_takes_only_the_head() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "A", 0, 1, 1.0)
    second = queue.push("b", "A", 1, 1, 1.0)
    with pytest.raises(AssertionError):
        queue.pop(second)
    with pytest.raises(ValueError, match="weight"):
        queue.push("z", "Z", 0, 1, 0.0)
