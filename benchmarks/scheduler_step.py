#!/usr/bin/env python
"""Host time of the scheduler's part of a steady decode step, the whole-batch plain-decode
reads (engine/plain_decodes.py) on and off, in one process, window by window interleaved.

B requests of 100 prompt tokens decode forever (ignore_eos) on 16-token blocks with prefix
caching on, as served: each step is `schedule()`, `update_after_step()` and the sampled token
appended. "off" is the per-request path alone (the finder answers None); the two schedulers
hold the same requests in the same states. Thread CPU time, medians of the windows: the same
process and interleaving keep a noisy host's drift out of the ratio, which is the figure that
`plain_decodes.MIN_ROWS` is chosen from.

    .venv/bin/python benchmarks/scheduler_step.py
    .venv/bin/python benchmarks/scheduler_step.py --batches 1,64,256 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import SchedulerConfig
from kvrelay.engine import plain_decodes
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64,128,256", help="decoding requests per step")
    parser.add_argument("--steps", type=int, default=32, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=15, help="timed windows per side")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser.parse_args(argv)


def make_scheduler(batch: int, plain: bool) -> Scheduler:
    """`batch` requests admitted; `plain` False: the per-request path decides every row."""
    kv = KVCacheManager(num_blocks=batch * 64 + 64, block_size=16, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=batch), kv)
    for i in range(batch):
        params = SamplingParams(max_tokens=100_000, ignore_eos=True)
        scheduler.add(Request(f"r{i}", list(range(i, i + 100)), params, 200_000))
    if not plain:
        scheduler._plain_decodes.find = lambda running: None  # type: ignore[method-assign]
    return scheduler


def step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    scheduler.update_after_step(out.chunks)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.output_token_ids.append(7)


def measure(batch: int, steps: int, windows: int) -> dict[str, float]:
    """Median microseconds per step with the reads on (at every batch size) and off."""
    sides = {"on": make_scheduler(batch, True), "off": make_scheduler(batch, False)}
    for scheduler in sides.values():
        for _ in range(steps):  # past the prompts: decoding
            step(scheduler)
    spent: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(windows):
        for name, scheduler in sides.items():
            start = time.thread_time()
            for _ in range(steps):
                step(scheduler)
            spent[name].append((time.thread_time() - start) / steps * 1e6)
    on, off = statistics.median(spent["on"]), statistics.median(spent["off"])
    return {"batch": batch, "us_per_step_on": on, "us_per_step_off": off, "ratio": on / off}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    served = plain_decodes.MIN_ROWS
    plain_decodes.MIN_ROWS = 1  # measured at every size: the threshold is what this finds
    rows = [measure(int(b), args.steps, args.windows) for b in args.batches.split(",")]
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| batch | plain-decode reads on, us/step | off (per request) | on / off |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['us_per_step_on']:.1f} | {r['us_per_step_off']:.1f} "
            f"| {r['ratio']:.2f} |"
        )
    print(f"\nserved: the reads run from plain_decodes.MIN_ROWS = {served} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
