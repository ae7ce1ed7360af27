"""Run a workload against one server: a test request, optional warm-ups, then the timed run
(paced arrivals, at most --max-concurrency in flight, a tqdm bar)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from .arrivals import paced, send_offsets
from .dataset import SampleRequest
from .openai_http import EndpointConfig, send_request
from .records import RequestRecord

HTTP_TIMEOUT = httpx.Timeout(6 * 60 * 60.0, connect=30.0)  # a long run is not an error


@dataclass(frozen=True)
class RunSettings:
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    show_progress: bool = True


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    duration: float  # seconds from the first send to the last response


async def run_benchmark(
    config: EndpointConfig, requests: Sequence[SampleRequest], settings: RunSettings
) -> RunResult:
    if not requests:
        raise ValueError("no requests to send")
    limits = httpx.Limits(
        max_connections=settings.max_concurrency, max_keepalive_connections=settings.max_concurrency
    )
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits) as client:
        print("Starting initial single prompt test run...")
        test = await send_request(client, config, requests[0])
        if not test.success:
            raise RuntimeError(f"the initial test request failed: {test.error}")
        print("Initial test run completed.")
        if settings.num_warmups:
            print(f"Warming up with {settings.num_warmups} requests...")
            await asyncio.gather(
                *(send_request(client, config, requests[0]) for _ in range(settings.num_warmups))
            )
        print("Starting main benchmark run...")
        print(f"Traffic request rate: {settings.request_rate}")
        kind = "Poisson process" if settings.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {settings.burstiness} ({kind})")
        print(f"Maximum request concurrency: {settings.max_concurrency}")
        return await _timed_run(client, config, requests, settings)


async def _timed_run(
    client: httpx.AsyncClient,
    config: EndpointConfig,
    requests: Sequence[SampleRequest],
    settings: RunSettings,
) -> RunResult:
    slots: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(settings.max_concurrency)
        if settings.max_concurrency
        else contextlib.nullcontext()
    )
    bar = tqdm(total=len(requests), disable=not settings.show_progress, unit="req")

    async def one(request: SampleRequest) -> RequestRecord:
        arrived = time.perf_counter()
        async with slots:
            record = await send_request(client, config, request)
        # start_time stays the send time (throughput maths); the slot wait is kept apart.
        record.client_queue_time = record.start_time - arrived
        bar.update(1)
        return record

    offsets = send_offsets(len(requests), settings.request_rate, settings.burstiness, settings.seed)
    start = time.perf_counter()
    tasks = [asyncio.create_task(one(r)) async for r in paced(requests, offsets)]
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return RunResult(records=records, duration=duration)
