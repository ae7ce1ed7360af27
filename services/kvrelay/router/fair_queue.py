"""Which waiting request gets the next free capacity: weighted fair share across tenants
(start-time fair queueing), then vLLM's `priority` within a tenant (lower first, ties by arrival).

Pure bookkeeping: no asyncio and no capacity of its own (admission.py decides what fits and
when). A tenant's virtual time is the service it was granted divided by its weight; the
tenant with the least goes next. A tenant that starts waiting begins at the clock (the start
time of the latest grant), so idle time is not banked as credit against the others.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Entry(Generic[T]):
    """A waiting item. `cost`: the service it is charged when granted (its sequences)."""

    item: T
    tenant: str
    priority: int
    cost: float
    weight: float
    arrival: int
    removed: bool = field(default=False, init=False)

    def key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[tuple[int, int], Entry[T]]]] = {}
        self._vtime: dict[str, float] = {}
        self._clock = 0.0
        self._arrivals = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def vtime(self, tenant: str) -> float:
        """The tenant's weighted service so far (0 for one never seen or forgotten)."""
        return self._vtime.get(tenant, 0.0)

    def push(self, item: T, tenant: str, priority: int, cost: float, weight: float) -> Entry[T]:
        """Queue `item`; a tenant that was not waiting starts at the clock."""
        if weight <= 0:
            raise ValueError(f"a tenant's weight must be > 0, got {weight}")
        heap = self._heaps.get(tenant)
        if heap is None:  # the tenant starts waiting: no credit for the time it was idle
            heap = self._heaps[tenant] = []
            self._vtime[tenant] = max(self.vtime(tenant), self._clock)
        entry = Entry(item, tenant, priority, cost, weight, next(self._arrivals))
        heapq.heappush(heap, (entry.key(), entry))
        self._len += 1
        return entry

    def peek(self) -> Entry[T] | None:
        """The entry that goes next (not removed): the head of the tenant with the least
        virtual time, ties by the head's arrival."""
        best: Entry[T] | None = None
        for tenant in list(self._heaps):
            head = self._head(tenant)
            if head is None:
                continue
            if best is None or (self._vtime[tenant], head.arrival) < (
                self._vtime[best.tenant],
                best.arrival,
            ):
                best = head
        return best

    def pop(self, entry: Entry[T]) -> None:
        """Take `entry` (from `peek`) out and charge its tenant for it."""
        heap = self._heaps[entry.tenant]
        assert heap and heap[0][1] is entry, "pop takes the entry peek returned"
        heapq.heappop(heap)
        self._len -= 1
        if self._head(entry.tenant) is None:
            del self._heaps[entry.tenant]
        self.charge(entry.tenant, entry.cost, entry.weight)

    def charge(self, tenant: str, cost: float, weight: float) -> None:
        """Count a grant to `tenant` (also one that never waited): it starts at its virtual
        time or the clock, whichever is later, and the clock moves to that start."""
        start = max(self.vtime(tenant), self._clock)
        self._clock = start
        self._vtime[tenant] = start + cost / weight

    def remove(self, entry: Entry[T]) -> None:
        """Withdraw a waiting entry (its client left); a no-op when already gone."""
        if entry.removed:
            return
        entry.removed = True
        self._len -= 1
        if entry.tenant in self._heaps and self._head(entry.tenant) is None:
            del self._heaps[entry.tenant]

    def forget(self, tenant: str) -> None:
        """Drop an idle tenant's virtual time (nothing waiting or running), so the table
        holds only tenants with work: one that comes back starts at the clock."""
        if tenant not in self._heaps:
            self._vtime.pop(tenant, None)

    def _head(self, tenant: str) -> Entry[T] | None:
        heap = self._heaps[tenant]
        while heap and heap[0][1].removed:  # withdrawn entries are dropped lazily
            heapq.heappop(heap)
        return heap[0][1] if heap else None
