"""Leases on prefilled requests' blocks: held until a decode engine pulls them, or until expiry.
A lease is also the one capability to read those blocks: its handle id, claimed once, by the
decode engine it is bound to, before it expires. No transport here; the KV server asks it.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Lease:
    request_id: str
    handle_id: str  # unguessable (handoff.py makes it); what a puller names
    block_ids: frozenset[int]  # the only blocks a pull under this lease may read
    expires_at: float
    decode_engine_id: str | None = None  # None until bound: then any one puller, once
    claimed: bool = False  # single use: set by the first pull allowed


class LeaseTable:
    """Request id -> lease (expiry in seconds on the caller's monotonic clock).

    Thread safety: every method takes one lock, because the engine loop grants, releases and
    expires leases while a KV server's threads claim them.
    """

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._by_handle: dict[str, str] = {}  # handle id -> request id
        self._heap: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def grant(
        self,
        request_id: str,
        expires_at: float,
        handle_id: str = "",
        block_ids: Sequence[int] = (),
    ) -> None:
        """Hold `request_id`'s blocks until `expires_at`; an empty `handle_id` makes a lease
        nobody can pull (only released or expired)."""
        lease = Lease(request_id, handle_id, frozenset(block_ids), expires_at)
        with self._lock:
            assert request_id not in self._leases, f"{request_id} already holds a lease"
            assert handle_id not in self._by_handle, "a handle id was made twice"
            self._leases[request_id] = lease
            if handle_id:
                self._by_handle[handle_id] = request_id
            heapq.heappush(self._heap, (expires_at, request_id))

    def bind(self, handle_id: str, decode_engine_id: str) -> bool:
        """Let only `decode_engine_id` pull `handle_id`; False when no such lease is held or
        it is bound to another engine already (a binding never changes)."""
        with self._lock:
            lease = self._lease_of(handle_id)
            if lease is None or lease.decode_engine_id not in (None, decode_engine_id):
                return False
            lease.decode_engine_id = decode_engine_id
            return True

    def claim(
        self, handle_id: str, requester: str, block_ids: Sequence[int], now: float
    ) -> str | None:
        """Allow one pull of `block_ids` under `handle_id` by the engine `requester`.

        Returns:
            None when allowed (the lease is then spent: a second claim is refused); else why
            not, for the prefill worker's log only (never for the caller).
        """
        with self._lock:
            lease = self._lease_of(handle_id)
            if lease is None:
                return "no lease holds that handle (never granted, released or expired)"
            if lease.expires_at <= now:
                return f"the lease of {lease.request_id} has expired"
            if lease.claimed:
                return f"the handle of {lease.request_id} was pulled already (a replay)"
            if lease.decode_engine_id not in (None, requester):
                return f"the handle of {lease.request_id} is bound to another decode engine"
            if not lease.block_ids.issuperset(block_ids):
                return f"blocks outside the lease of {lease.request_id} were asked for"
            lease.claimed = True
            return None

    def release(self, request_id: str) -> bool:
        """End a lease; False if there was none (already released or expired)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self._by_handle.pop(lease.handle_id, None)
            return True

    def pop_expired(self, now: float) -> list[str]:
        """End and return every lease that expired at or before `now`."""
        expired = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                expires_at, request_id = heapq.heappop(self._heap)
                lease = self._leases.get(request_id)
                if lease is not None and lease.expires_at == expires_at:
                    del self._leases[request_id]
                    self._by_handle.pop(lease.handle_id, None)
                    expired.append(request_id)
            self.num_expired += len(expired)
        return expired

    def _lease_of(self, handle_id: str) -> Lease | None:
        request_id = self._by_handle.get(handle_id) if handle_id else None
        return None if request_id is None else self._leases.get(request_id)
