"""Admission control: at most `max_in_flight` requests run, at most `max_queued` wait.

A request beyond both is refused at once (RESOURCE_EXHAUSTED / 429 with a Retry-After), so
overload costs the client one round trip, not a timeout. An admitted request is never dropped:
it waits its turn in arrival order.

`reserve` decides synchronously, so an API can answer 429 before it starts a response stream
and two requests arriving together can never both take the last place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from kvrelay.router.request_errors import OverloadedError, UnavailableError


class Ticket:
    """A reserved place: a running slot already, or a place in the queue. `release` it
    exactly once (more calls are no-ops), whether or not it was ever used."""

    def __init__(self, controller: AdmissionController, waiter: asyncio.Future[None] | None):
        self._controller = controller
        self._waiter = waiter
        self._released = False

    async def wait(self) -> None:
        """Until the ticket holds a running slot."""
        if self._waiter is not None:
            await asyncio.shield(self._waiter)  # a cancelled caller keeps the place; release

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        waiter = self._waiter
        if waiter is None or (waiter.done() and not waiter.cancelled()):
            self._controller._release()  # held a slot (or was just handed one)
        else:
            waiter.cancel()
            self._controller._forget(waiter)


class AdmissionController:
    def __init__(self, max_in_flight: int, max_queued: int, retry_after_s: float = 1.0) -> None:
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queued >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def close(self) -> None:
        """Refuse new requests (draining); admitted and queued ones go on."""
        self._closed = True

    def reserve(self) -> Ticket:
        """A running slot or a queue place, now; raises when there is neither."""
        if self._closed:
            raise UnavailableError("the server is shutting down; retry on another replica")
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return Ticket(self, None)
        if len(self._waiters) >= self.max_queued:
            raise OverloadedError(
                f"the server is at capacity ({self.in_flight} requests running, "
                f"{len(self._waiters)} queued); retry after {self.retry_after_s:g} s",
                self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return Ticket(self, waiter)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Reserve, wait for and hold one running slot for the body."""
        ticket = self.reserve()
        try:
            await ticket.wait()
            yield
        finally:
            ticket.release()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; in_flight is unchanged
                return
        self.in_flight -= 1

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
