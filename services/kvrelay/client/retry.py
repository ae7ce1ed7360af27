"""When and how long to wait before re-sending a call: exponential backoff with jitter.

Pure policy (no sleeping, no gRPC calls), shared by the sync and asyncio clients. The clients
only ask it before a call's first response has arrived: a request whose tokens were already
streamed is never sent again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvrelay.client.errors import KVRelayError, OverloadedError

__all__ = ["Deadline", "RetryEvent", "RetryHook", "RetryPolicy"]

# UNAVAILABLE: nothing listening, draining, no worker; RESOURCE_EXHAUSTED: the router is full.
# Both mean "the request was not taken", so sending it again cannot duplicate work.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryEvent:
    """Passed to the client's `on_retry` hook before each wait: the failed attempt (0-based),
    the error it raised and the seconds the client will now sleep."""

    attempt: int
    error: KVRelayError
    delay: float


RetryHook = Callable[[RetryEvent], None]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: attempt k (0-based) waits about `initial_backoff * multiplier**k`,
    capped at `max_backoff`, shortened by up to `jitter` of itself at random so that many
    clients failing together do not retry in lockstep.

    An `OverloadedError` with a server `retry_after` hint waits at least that long (the server
    knows its queue better than the backoff curve does).
    """

    max_retries: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError("initial_backoff and max_backoff must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt `attempt` (0-based), jitter applied."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        u = (rng or random).random()
        return base * (1.0 - self.jitter * u)

    def delay_before_retry(
        self,
        attempt: int,
        error: KVRelayError,
        remaining: float | None,
        rng: random.Random | None = None,
    ) -> float | None:
        """Seconds to wait before re-sending after `error` ended attempt `attempt`, or None
        when the call must fail now: the code is not retryable, the retries are spent, or the
        wait would outlast the deadline (`remaining` seconds; None means no deadline).
        """
        if error.code not in RETRYABLE_CODES or attempt >= self.max_retries:
            return None
        delay = self.backoff(attempt, rng)
        if isinstance(error, OverloadedError) and error.retry_after is not None:
            delay = max(delay, error.retry_after)
        if remaining is not None and delay >= remaining:
            return None
        return delay


class Deadline:
    """A call's absolute deadline on the monotonic clock, spanning all of its attempts."""

    def __init__(self, timeout: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        self._clock = clock
        self._end = None if timeout is None else clock() + timeout

    def remaining(self) -> float | None:
        """Seconds left (may be <= 0 once passed), or None without a deadline."""
        return None if self._end is None else self._end - self._clock()

    @property
    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0
