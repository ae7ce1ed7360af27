"""Async scheduling on fake CUDA (engine/async_step.py), in a process of its own:
`python -m tests.fake_cuda.async_scenarios OUT.json`; tests/engine/test_fake_cuda_async.py
asserts on the report. Every step runs under the strict rules (mode.py): the only device
value the host reads is each step's sampled ids, from their pinned copy after its event;
the order of launches and reads is logged, to show that step n+1 is launched before step
n's tokens are read."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay_kernels.counters import COUNTERS
from tests.fake_cuda import runtime
from tests.fake_cuda.mode import FakeCudaMode
from tests.fake_cuda.scenarios import (
    SAMPLED,
    fake_sampling,
    install_rig,
    make_engine,
    run_one,
    write_model,
)
from tests.fake_cuda.timeline import Timeline, watch

TOKENS = 6


def run_async(engine: Engine, mode: FakeCudaMode, timeline: Timeline) -> dict[str, Any]:
    """step_delta to the end under the strict rules; streamed tokens and the outcome."""
    streamed: dict[str, list[int]] = {}
    finished: dict[str, list[int]] = {}
    waits: list[int] = []
    with mode.strict_rules():
        for _ in range(200):
            if not engine.has_work():
                break
            before = runtime.LOG.events_waited
            timeline.mark("step")
            ids, tokens, outputs = engine.step_delta()
            waits.append(runtime.LOG.events_waited - before)
            for rid, token in zip(ids, tokens, strict=True):
                streamed[rid].append(token)
            for out in outputs:
                streamed[out.request_id] = list(out.outputs[0].token_ids)
                if out.finished:
                    finished[out.request_id] = streamed[out.request_id]
    return {
        "finished": finished,
        "log": timeline.kinds(),
        "waits_per_step": waits,
        "pool_whole": engine.kv_cache.pool.is_whole(),
        "launched": engine.overlap.launched if engine.overlap is not None else 0,
    }


def scenario_overlap(model: Path, mode: FakeCudaMode, **overrides: Any) -> dict[str, Any]:
    """Greedy decodes (graphed), a prompt prefilled in chunks while they decode (mixed
    steps), a request that stops at its first token (its next row, launched, discarded)."""
    engine = make_engine(model, max_num_batched_tokens=32, **overrides)
    assert engine.overlap is not None, "async scheduling is on by default on CUDA"
    fake_sampling(engine)
    timeline = Timeline(time.perf_counter)
    watch(engine, timeline)
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"d{i}", [4 + i] * (5 + i), greedy)
    # min_tokens overlaps too: its mask counts the token in flight (on the device, no sync).
    masked = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=3, ignore_eos=True)
    engine.add_request("masked", [6, 7, 8, 9], masked)
    engine.add_request("long", list(range(3, 100)), greedy)
    stop = SamplingParams(temperature=0.0, max_tokens=TOKENS, stop_token_ids=[SAMPLED])
    engine.add_request("stops", [9, 9, 9], stop)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=TOKENS, ignore_eos=True)
    engine.add_request("seeded", [5, 6, 7], seeded)
    return run_async(engine, mode, timeline)


def main(out: Path) -> None:
    mode = install_rig()
    hd64 = write_model(out.parent / "llama-hd64", 64)
    scenarios: dict[str, Callable[[], Any]] = {
        "graphs": lambda: scenario_overlap(hd64, mode),
        "eager": lambda: scenario_overlap(hd64, mode, enforce_eager=True),
    }
    results: dict[str, Any] = {}
    with mode:
        for name, run in scenarios.items():
            replays = COUNTERS.graph_replays
            results[name] = run_one(mode, run)
            results[name]["graph_replays"] = COUNTERS.graph_replays - replays
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
