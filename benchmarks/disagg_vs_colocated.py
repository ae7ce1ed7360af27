#!/usr/bin/env python
"""Prefill-decode interference: running decode streams while long prompts keep arriving.

The same offered load runs twice, in one process, on the default model:
- disaggregated: 1 prefill + 1 decode worker (Ray actors, KV relayed over NIXL or gRPC);
- colocated: 2 workers doing both (requests spread round-robin).
Every request goes through the router's relay (router/relay.py), as served traffic does.
Short-prompt streams start together and decode for a while; long prompts arrive at a fixed
interval meanwhile. Prints inter-token latency p50 / p99 of the streams and time to first
token of the long prompts, per mode, and the disaggregated / colocated ratios.

    .venv/bin/python benchmarks/disagg_vs_colocated.py            # default load
    .venv/bin/python benchmarks/disagg_vs_colocated.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay import SamplingParams


@dataclass
class Trace:
    """Arrival times of one request's tokens."""

    submitted: float
    first_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # between successive token arrivals


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def run_request(router: Any, index: int, prompt: list[int], params: SamplingParams) -> Trace:
    """Send one request through the router's relay; record when its tokens arrive."""
    from kvrelay.router.types import GenerateRequest

    trace = Trace(submitted=time.perf_counter())
    last_time: float | None = None
    async for chunk in router.generate(GenerateRequest(f"req-{index}", prompt, params)):
        new = sum(len(choice.token_ids) for choice in chunk.choices if choice.index == 0)
        if new == 0:
            continue
        now = time.perf_counter()
        if trace.first_token is None:
            trace.first_token = now
            new -= 1
        if new and last_time is not None:
            # A step that delivered k tokens at once counts as k gaps of equal share.
            trace.gaps.extend([(now - last_time) / new] * new)
        last_time = now
    return trace


async def offered_load(router: Any, args: argparse.Namespace) -> tuple[list[Trace], list[Trace]]:
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, 49152) for _ in range(length)]

    stream_params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=args.long_tokens, ignore_eos=True)
    streams = [
        asyncio.create_task(run_request(router, i, prompt(args.stream_prompt), stream_params))
        for i in range(args.streams)
    ]
    await asyncio.sleep(args.warmup)  # let the streams reach steady decoding
    longs = []
    for j in range(args.long_count):
        longs.append(
            asyncio.create_task(
                run_request(router, 1000 + j, prompt(args.long_prompt), long_params)
            )
        )
        await asyncio.sleep(args.long_every)
    return list(await asyncio.gather(*streams)), list(await asyncio.gather(*longs))


async def measure(
    pools: Any, mode: str, args: argparse.Namespace
) -> tuple[list[Trace], list[Trace]]:
    """A router over the pools (every prompt prefilled by the prefill pool when disaggregated;
    round-robin over the colocated workers), warmed up, then the offered load."""
    from kvrelay.config import RouterConfig
    from kvrelay.router.local import local_router

    policy = "round_robin" if mode == "colocated" else "score"
    config = RouterConfig(max_local_prefill_tokens=0, routing_policy=policy)
    router = await local_router(pools.workers, config=config)
    # Warm every worker (kernels, first transfer) outside the measurement.
    for warm in range(2):
        await run_request(router, 999_990 + warm, [5] * 64, SamplingParams(max_tokens=4))
    return await offered_load(router, args)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, float]:
    import ray

    from kvrelay.worker.pools import Pools

    engine_kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens}
    if mode == "disaggregated":
        pools = Pools.start(
            args.model, 1, 1, transfer_backend=args.transfer, engine_kwargs=engine_kwargs
        )
    else:
        pools = Pools.start(args.model, num_decode=2, colocated=True, engine_kwargs=engine_kwargs)
    try:
        streams, longs = asyncio.run(measure(pools, mode, args))
        stats = pools.stats()
    finally:
        pools.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    assert all(s.num_free_blocks == s.num_blocks for s in stats), "a worker leaked KV blocks"
    gaps = [g for t in streams for g in t.gaps]
    ttft = [t.first_token - t.submitted for t in longs if t.first_token is not None]
    return {
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "ttft_long_median_s": statistics.median(ttft),
        "fallbacks": float(sum(s.kv_pull_fallbacks for s in stats)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--streams", type=int, default=6, help="concurrent decode streams")
    parser.add_argument("--stream-prompt", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--long-prompt", type=int, default=1024, help="tokens of each long prompt")
    parser.add_argument("--long-tokens", type=int, default=4)
    parser.add_argument("--long-count", type=int, default=4)
    parser.add_argument("--long-every", type=float, default=2.0, help="seconds between long ones")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before the first long")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--transfer", default="auto", help="nixl, grpc or auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small load, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.stream_tokens, args.long_count, args.long_prompt = 2, 48, 2, 256
    if args.model is None:
        from kvrelay.models.default_model import pull_default_model

        args.model = str(pull_default_model())

    results = {mode: run_mode(mode, args) for mode in ("disaggregated", "colocated")}
    dis, col = results["disaggregated"], results["colocated"]
    print(
        f"\n{args.streams} streams x {args.stream_tokens} tokens; {args.long_count} prompts of "
        f"{args.long_prompt} tokens every {args.long_every} s\n"
    )
    print("| mode | ITL p50 (ms) | ITL p99 (ms) | long-prompt TTFT median (s) | pull fallbacks |")
    print("|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
            f"{r['ttft_long_median_s']:.2f} | {r['fallbacks']:.0f} |"
        )
    print(
        f"| **disaggregated / colocated** | {dis['itl_p50_ms'] / col['itl_p50_ms']:.2f}x | "
        f"**{dis['itl_p99_ms'] / col['itl_p99_ms']:.2f}x** | "
        f"{dis['ttft_long_median_s'] / col['ttft_long_median_s']:.2f}x | |"
    )
    print("\ntarget: ITL p99 disaggregated <= 0.5x colocated")


if __name__ == "__main__":
    main()
