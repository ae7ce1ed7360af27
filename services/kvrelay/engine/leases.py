"""Leases on prefilled requests' blocks: held until a decode engine pulls them, or until expiry."""

from __future__ import annotations

import heapq


class LeaseTable:
    """Request id -> expiry time (seconds on the caller's monotonic clock)."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._expiry

    def grant(self, request_id: str, expires_at: float) -> None:
        assert request_id not in self._expiry, f"{request_id} already holds a lease"
        self._expiry[request_id] = expires_at
        heapq.heappush(self._heap, (expires_at, request_id))

    def release(self, request_id: str) -> bool:
        """End a lease; False if there was none (already released or expired)."""
        return self._expiry.pop(request_id, None) is not None

    def pop_expired(self, now: float) -> list[str]:
        """End and return every lease that expired at or before `now`."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, request_id = heapq.heappop(self._heap)
            if self._expiry.get(request_id) == expires_at:
                del self._expiry[request_id]
                expired.append(request_id)
        self.num_expired += len(expired)
        return expired
