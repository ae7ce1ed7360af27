"""Requests leave nothing behind in a worker (issue 41, flat memory): after relayed requests of
varied lengths, n = 2 run whole on the decode worker, a decode stream left mid-way, a prefill
cancelled mid-way and a lease released unpulled, every per-request structure of a real
prefill and decode EngineWorker (worker/memory_probe.py's WORKER_STRUCTURES) is back to its
size before them, and every KV block is free or only in the prefix cache. In-process workers
on the tiny model, gRPC KV."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.common.messages import EngineRequest, KVHandle, Role
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay.worker.actor import EngineWorker
from kvrelay.worker.deltas import request_deltas
from kvrelay.worker.memory_probe import WORKER_STRUCTURES, structure_sizes
from tests.transfer.plans import SECRET
from tests.worker.conftest import TINY_ENGINE_KWARGS

CACHE = "engine.kv_cache.pool._cached"  # the prefix cache: bounded by the pool, kept on purpose
# Kept until the next step, so bounded, not residue: the requests whose block table changed
# since the last step (the leases released after it) and the last step's batch.
UNTIL_NEXT_STEP = {
    "engine.kv_cache._changed": 2,
    "engine.scheduler._last_running": TINY_ENGINE_KWARGS["max_num_seqs"],
    "engine.scheduler._last_order": TINY_ENGINE_KWARGS["max_num_seqs"],
}
UPLOADER = "engine.runner.uploader.table._row_of"  # a device's block table; none on a CPU


def params(tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, n=n)


@pytest.fixture
def pair(tiny_llama_dir: Path) -> Iterator[tuple[EngineWorker, EngineWorker]]:
    args = EngineArgs.from_kwargs(str(tiny_llama_dir), dict(TINY_ENGINE_KWARGS))
    prefill = EngineWorker(args, Role.PREFILL, "grpc", kv_secret=SECRET)
    decode = EngineWorker(args, Role.DECODE, "grpc", kv_secret=SECRET)
    decode.add_peer(prefill.kv_metadata())
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def sizes(worker: EngineWorker) -> dict[str, int]:
    """The sizes that must come back exactly: the prefix cache left out, and those kept
    until the next step as 0 while within their bound."""
    found = structure_sizes(worker)
    found.pop(CACHE)
    for path, bound in UNTIL_NEXT_STEP.items():
        if found[path] <= bound:
            found[path] = 0
    return found


async def settled(worker: EngineWorker, expected: dict[str, int]) -> dict[str, int]:
    """The worker's sizes once they equal `expected`, or after 5 s (the loop thread finishes
    an abort between steps)."""
    deadline = time.monotonic() + 5
    while True:
        await worker.stats()  # a command on the loop thread: what was queued before has run
        found = sizes(worker)
        if found == expected or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


async def relay(
    prefill: EngineWorker, decode: EngineWorker, rid: str, prompt: list[int], p: SamplingParams,
    leave_after: int | None = None,
) -> None:  # fmt: skip
    """Prefill, pull and decode `rid` (leaving the decode stream after `leave_after`
    deltas), then release its lease, as the router's relay does."""
    first = await prefill.prefill(EngineRequest(rid, prompt, p), decode.engine.engine_id)
    if isinstance(first.kv_handle, KVHandle):
        request = EngineRequest(rid, prompt, p, first.kv_handle)
        seen = 0
        async for _ in request_deltas(decode.loop, request):
            seen += 1
            if seen == leave_after:
                break  # leaving the stream aborts the request
    await prefill.release_kv(rid)


async def cancelled_prefill(prefill: EngineWorker, rid: str) -> None:
    """A prefill the router gave up on while it ran (a client that hung up): cancelled once
    the loop has it, mid-way through its chunks unless it already finished."""
    long_prompt = [3 + i % 120 for i in range(180)]  # several chunks of max_num_batched_tokens
    task = asyncio.ensure_future(prefill.prefill(EngineRequest(rid, long_prompt, params(4))))
    while rid not in prefill.loop._streams and not task.done():
        await asyncio.sleep(0.001)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await prefill.release_kv(rid)  # in case it finished first: its lease goes


async def test_requests_leave_no_residue_in_either_worker(
    pair: tuple[EngineWorker, EngineWorker],
) -> None:
    prefill, decode = pair
    assert set(WORKER_STRUCTURES) - {CACHE} <= set(sizes(prefill))
    before = (sizes(prefill), sizes(decode))
    unresolved = {k for k, v in before[0].items() if v < 0}
    assert unresolved <= {UPLOADER}, unresolved  # every path resolves (no uploader on a CPU)
    for i in range(6):
        prompt = list(range(5 + i, 5 + i + 9 + 13 * i))  # 9 .. 74 tokens
        await relay(prefill, decode, f"r{i}", prompt, params(3 + i))
    async for _ in request_deltas(decode.loop, EngineRequest("whole", [5, 6, 7], params(5, n=2))):
        pass  # short or n > 1: run whole on the decode worker
    await relay(prefill, decode, "left", list(range(7, 40)), params(30), leave_after=2)
    await cancelled_prefill(prefill, "cancelled")
    unpulled = await prefill.prefill(EngineRequest("unpulled", list(range(9, 30)), params(4)))
    assert isinstance(unpulled.kv_handle, KVHandle)  # a lease the router then released
    assert await prefill.release_kv("unpulled")
    after = (await settled(prefill, before[0]), await settled(decode, before[1]))
    assert after == before
    for worker in pair:
        stats = await worker.stats()
        cached = len(worker.engine.kv_cache.pool._cached)
        assert stats.num_free_blocks == stats.num_blocks and cached <= stats.num_blocks
