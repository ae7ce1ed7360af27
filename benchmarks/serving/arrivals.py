"""When each request is sent: all at once (rate inf) or gamma-distributed gaps.

Burstiness 1 is a Poisson process (exponential gaps); below 1 burstier, above 1 more regular.
Like vLLM, the gaps are rescaled so that the n requests span exactly n / rate seconds, which
keeps runs with different seeds comparable.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def send_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of n requests is sent (non-decreasing)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if n == 0 or math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return [float(x) for x in offsets]


async def paced(items: Sequence[T], offsets: Sequence[float]) -> AsyncIterator[T]:
    """Yield each item at its offset from the moment iteration starts."""
    start = time.perf_counter()
    for item, offset in zip(items, offsets, strict=True):
        wait = start + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield item
