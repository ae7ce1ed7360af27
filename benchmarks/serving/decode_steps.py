"""The offline engine's decode step time, as the CPU benchmarks measure it (step_overhead.py,
blocked_matmul.py, huge_pages.py): one place, so that they all time the same thing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any


def decode_step_ms(
    engine: Any, prompt: Sequence[int], params: Any, request_id: str, streams: int = 1
) -> float:
    """Median wall time in ms of the decode steps of `streams` fresh greedy streams of
    `prompt`, run to their end. The first step (the prompts' prefills, one step for short
    prompts) is not timed; `request_id` prefixes the requests' ids (each call a new one)."""
    for i in range(streams):
        engine.add_request(f"{request_id}-{i}", list(prompt), params)
    engine.step()  # the prefill step (and its first token) is not a decode step
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if not times:
        raise ValueError("the streams ended at their prefill: ask for more than one token")
    return 1000 * statistics.median(times)
