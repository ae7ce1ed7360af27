"""Admission control by what a request costs: its sequences (`n`, per prompt) against
`max_in_flight` running and `max_queued` waiting, and the KV tokens they may hold against the
decode pools' capacity (times KV_OVERCOMMIT). A request beyond both bounds is refused at once
(RESOURCE_EXHAUSTED / 429 with a Retry-After), so overload costs the client one round trip,
not a timeout. An admitted request is never dropped: it waits its turn, and the turn goes to
the tenant with the least weighted service so far, then by `priority` within the tenant
(fair_queue.py). A request that could never run (more sequences than `max_in_flight`) is the
caller's to refuse first (`never_fits`).

`reserve` decides synchronously, so an API can answer 429 before it starts a response stream
and two requests arriving together can never both take the last place. Every ticket is
released exactly once (more calls are no-ops), whether it ran, waited or never started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvrelay.router.fair_queue import Entry, FairQueue
from kvrelay.router.request_errors import InvalidRequestError, OverloadedError, UnavailableError
from kvrelay.router.tenant_limits import DEFAULT_TENANT, TenantLimitError

# The KV budget is this many times the decode pools' capacity: each request is counted at its
# worst case (prompt + max_tokens, or the context length), which few reach, and the engine
# preempts when the pool is really full; 1 would leave most of the pool idle.
KV_OVERCOMMIT = 4


class Cost(NamedTuple):
    """What one request holds while it runs."""

    sequences: int = 1
    kv_tokens: int = 0  # 0: not counted (no capacity known)


@dataclass(frozen=True)
class Claim:
    """Who asks, and how their turn is decided."""

    tenant: str = DEFAULT_TENANT
    priority: int = 0  # lower first within the tenant (vLLM's)
    weight: float = 1.0  # the tenant's share
    max_sequences: int | None = None  # the tenant's running + queued sequences at most


ONE = Cost()
ANYONE = Claim()


class Ticket:
    """A reserved place: a running slot already, or a place in the queue. `release` it
    exactly once (more calls are no-ops), whether or not it was ever used."""

    def __init__(self, controller: AdmissionController, cost: Cost, claim: Claim) -> None:
        self._controller = controller
        self.cost = cost
        self.claim = claim
        self._waiter: asyncio.Future[None] | None = None
        self._entry: Entry[Ticket] | None = None
        self._released = False

    @property
    def granted(self) -> bool:
        """Holds running capacity (it may not have resumed from `wait` yet)."""
        waiter = self._waiter
        return waiter is None or (waiter.done() and not waiter.cancelled())

    async def wait(self) -> None:
        """Until the ticket holds a running slot."""
        if self._waiter is not None:
            await asyncio.shield(self._waiter)  # a cancelled caller keeps the place; release

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._controller._release(self)


class AdmissionController:
    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        retry_after_s: float = 1.0,
        kv_capacity: Callable[[], int] | None = None,
    ) -> None:
        """`max_in_flight` / `max_queued`: sequences. `kv_capacity`: tokens of KV the decode
        pools hold now (0 or None: KV is not counted)."""
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queued >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self._kv_capacity = kv_capacity or (lambda: 0)
        self.in_flight = 0  # sequences holding running capacity
        self.queued = 0  # sequences waiting
        self.kv_in_use = 0  # KV tokens counted for the running ones
        self.requests_in_flight = 0
        self.requests_queued = 0
        self._by_tenant: dict[str, int] = {}  # running + queued sequences
        self._queue: FairQueue[Ticket] = FairQueue()
        self._closed = False

    @property
    def kv_budget(self) -> int:
        return self._kv_capacity() * KV_OVERCOMMIT

    def tenant_sequences(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def close(self) -> None:
        """Refuse new requests (draining); admitted and queued ones go on."""
        self._closed = True

    def never_fits(self, cost: Cost) -> str | None:
        """Why `cost` could never run here ("sequences" or "kv"), or None. KV counts only for
        several sequences: a single one is let run (alone if need be; the engine preempts)."""
        if cost.sequences > self.max_in_flight:
            return "sequences"
        capacity = self._kv_capacity()
        if cost.sequences > 1 and capacity and cost.kv_tokens > capacity:
            return "kv"
        return None

    def reserve(self, cost: Cost = ONE, claim: Claim = ANYONE) -> Ticket:
        """A running slot or a queue place, now; raises when there is neither."""
        if self._closed:
            raise UnavailableError("the server is shutting down; retry on another replica")
        if self.never_fits(cost) == "sequences":  # callers refuse first, naming their field
            raise InvalidRequestError(
                f"{cost.sequences} sequences is more than this server runs at once "
                f"({self.max_in_flight}): lower n",
                "n",
            )
        self._check_tenant(cost, claim)
        ticket = Ticket(self, cost, claim)
        if not len(self._queue) and self._fits(cost):
            self._queue.charge(claim.tenant, cost.sequences, claim.weight)
            self._hold(ticket)
        elif self.queued + cost.sequences > self.max_queued:
            raise OverloadedError(
                f"the server is at capacity ({self.in_flight} sequences running, "
                f"{self.queued} queued); retry after {self.retry_after_s:g} s",
                self.retry_after_s,
            )
        else:
            ticket._waiter = asyncio.get_running_loop().create_future()
            ticket._entry = self._queue.push(
                ticket, claim.tenant, claim.priority, cost.sequences, claim.weight
            )
            self.queued += cost.sequences
            self.requests_queued += 1
        self._by_tenant[claim.tenant] = self.tenant_sequences(claim.tenant) + cost.sequences
        self._dispatch()  # a newcomer may be the fairest head that fits
        return ticket

    @contextlib.asynccontextmanager
    async def slot(self, cost: Cost = ONE, claim: Claim = ANYONE) -> AsyncIterator[None]:
        """Reserve, wait for and hold running capacity for the body."""
        ticket = self.reserve(cost, claim)
        try:
            await ticket.wait()
            yield
        finally:
            ticket.release()

    def _check_tenant(self, cost: Cost, claim: Claim) -> None:
        limit = claim.max_sequences
        held = self.tenant_sequences(claim.tenant)
        if limit is not None and held + cost.sequences > limit:
            raise TenantLimitError(
                f"this key has {held} sequences running or queued and may have {limit} "
                f"(max_concurrent_sequences); this request needs {cost.sequences}: retry when "
                "one of its requests finishes",
                self.retry_after_s,
                claim.tenant,
                "max_concurrent_sequences",
            )

    def _fits(self, cost: Cost) -> bool:
        if self.in_flight + cost.sequences > self.max_in_flight:
            return False
        budget = self.kv_budget
        # Nothing running: it runs even beyond the budget, so nothing waits forever.
        return not budget or not self.in_flight or self.kv_in_use + cost.kv_tokens <= budget

    def _hold(self, ticket: Ticket) -> None:
        self.in_flight += ticket.cost.sequences
        self.kv_in_use += ticket.cost.kv_tokens
        self.requests_in_flight += 1

    def _dispatch(self) -> None:
        """Grant waiting tickets while the fairest head fits. The head is never skipped for a
        smaller one behind it, so a large request is not starved by a stream of small ones."""
        while (entry := self._queue.peek()) is not None and self._fits(entry.item.cost):
            self._queue.pop(entry)
            ticket = entry.item
            self.queued -= ticket.cost.sequences
            self.requests_queued -= 1
            self._hold(ticket)
            assert ticket._waiter is not None
            ticket._waiter.set_result(None)

    def _release(self, ticket: Ticket) -> None:
        cost, tenant = ticket.cost, ticket.claim.tenant
        if ticket.granted:
            self.in_flight -= cost.sequences
            self.kv_in_use -= cost.kv_tokens
            self.requests_in_flight -= 1
        else:
            assert ticket._waiter is not None and ticket._entry is not None
            ticket._waiter.cancel()
            self._queue.remove(ticket._entry)
            self.queued -= cost.sequences
            self.requests_queued -= 1
        left = self.tenant_sequences(tenant) - cost.sequences
        if left:
            self._by_tenant[tenant] = left
        else:
            self._by_tenant.pop(tenant, None)
            self._queue.forget(tenant)
        self._dispatch()
