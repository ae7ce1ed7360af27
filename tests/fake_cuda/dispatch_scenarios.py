"""The decode dispatch (kvrelay_kernels/decode_dispatch.py) in whole engines on fake CUDA, run
in a process of its own: `python -m tests.fake_cuda.dispatch_scenarios OUT.json`, asserted on by
tests/engine/test_fake_cuda_dispatch.py.

Each scenario builds an engine (graphs on unless it says otherwise) and runs the mixed requests
of scenarios.py under the strict rules. Every call of `kernel_for_step` is recorded with the
number of kernel launches logged so far, so the test can pair each choice with the decode
launch that followed it ("decode": the CUDA kernel, "triton_decode": the Triton one). The
made-up timings reach the engine the only way timings may on fake CUDA: a test's injection
(here `decode_timing.measure` and `can_time` replaced), never the rig's own clock.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvrelay.engine.cuda_graphs import DecodeGraphs
from kvrelay_kernels import decode_dispatch, decode_timing
from kvrelay_kernels.counters import COUNTERS
from kvrelay_kernels.env import DECODE_ATTENTION
from tests.fake_cuda import kernels, runtime
from tests.fake_cuda.mode import FakeCudaMode
from tests.fake_cuda.scenarios import (
    add_mixed_requests,
    fake_sampling,
    install_rig,
    make_engine,
    run_one,
    run_steps,
    write_model,
)

US = 1e-6
# Made-up seconds per call, (kernel, batch, context) -> s: batch 1 is the CUDA kernel's at
# every context; batch 16 too at context 128 (the rig's steps read about 3-210 keys), but
# Triton's from 512 on, by enough that the row's sums give its graphs to Triton; 64 and 256
# Triton's everywhere.
MADE_UP: dict[tuple[str, int, int], float] = {}
for _context in decode_dispatch.CONTEXT_BUCKETS:
    MADE_UP[("cuda", 1, _context)], MADE_UP[("triton", 1, _context)] = 10 * US, 20 * US
    for _batch in (64, 256):
        MADE_UP[("cuda", _batch, _context)] = _context * _batch / 100 * US
        MADE_UP[("triton", _batch, _context)] = _context * _batch / 400 * US
MADE_UP.update({
    ("cuda", 16, 128): 10 * US, ("triton", 16, 128): 15 * US,
    ("cuda", 16, 512): 40 * US, ("triton", 16, 512): 20 * US,
    ("cuda", 16, 2048): 160 * US, ("triton", 16, 2048): 60 * US,
    ("cuda", 16, 8192): 640 * US, ("triton", 16, 8192): 200 * US,
})  # fmt: skip


def as_key(key: tuple[str, int, int]) -> str:
    """A timing's key as JSON can carry it."""
    return "/".join(str(part) for part in key)


def record_choices(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record each `kernel_for_step` call: its step, its answer, and how many launches were
    logged before it (the next decode launch is the one it chose)."""
    choices: list[dict[str, Any]] = []
    choose = decode_dispatch.kernel_for_step

    def recorded(num_heads: int, kv_cache: Any, batch: int, context: int, graphed: bool,
                 *variants: bool) -> str:  # fmt: skip
        kernel = choose(num_heads, kv_cache, batch, context, graphed, *variants)
        choices.append({"batch": batch, "context": context, "graphed": graphed,
                        "kernel": kernel, "logged": len(kernels.LOG.calls)})  # fmt: skip
        return kernel

    monkeypatch.setattr(decode_dispatch, "kernel_for_step", recorded)
    return choices


def run_engine(model: Path, mode: FakeCudaMode, **overrides: Any) -> dict[str, Any]:
    """An engine's life (load, warm-up, capture, the mixed requests) with its choices."""
    replayed: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        choices = record_choices(patch)
        replay = DecodeGraphs.replay

        def recorded_replay(self: DecodeGraphs, size: int, *args: Any) -> Any:
            replayed.append(size)
            return replay(self, size, *args)

        patch.setattr(DecodeGraphs, "replay", recorded_replay)
        engine = make_engine(model, **overrides)
        loaded = len(kernels.LOG.calls)
        fake_sampling(engine)
        add_mixed_requests(engine)
        result = run_steps(engine, mode)
    result.update(
        choices=choices,
        replayed=replayed,
        launches=list(kernels.LOG.calls),
        loaded=loaded,
        graph_sizes=engine.runner.graphs.sizes if engine.runner.graphs else [],
        tables=[t.describe() for t in decode_dispatch.installed()],
    )
    return result


def scenario_pinned(model: Path, mode: FakeCudaMode, kernel: str) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DECODE_ATTENTION.name, kernel)
        return run_engine(model, mode)


def scenario_made_up(model: Path, mode: FakeCudaMode, **overrides: Any) -> dict[str, Any]:
    """`auto`, with MADE_UP as what the device measured."""
    measured: list[str] = []

    def measure(shape: Any, calls: Any, kv_cache: Any, **_: Any) -> dict[Any, float]:
        measured.append(",".join(sorted(calls)))  # the kernels it was handed to time
        return dict(MADE_UP)

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(DECODE_ATTENTION.name, raising=False)
        patch.setattr(decode_timing, "can_time", lambda _: True)
        patch.setattr(decode_timing, "measure", measure)
        result = run_engine(model, mode, **overrides)
    return {**result, "measured": measured}


def scenario_unmeasured(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """`auto` on fake CUDA with nothing injected: nothing may be timed here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(DECODE_ATTENTION.name, raising=False)
        return run_engine(model, mode)


def scenario_bad_pin(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DECODE_ATTENTION.name, "fastest")
        try:
            make_engine(model)
        except ValueError as error:
            return {"refused": str(error)}
    return {"refused": None}


def main(out: Path) -> None:
    mode = install_rig()
    hd64 = write_model(out.parent / "llama-hd64", 64)
    scenarios: dict[str, Callable[[], Any]] = {
        "pinned_cuda": lambda: scenario_pinned(hd64, mode, "cuda"),
        "pinned_triton": lambda: scenario_pinned(hd64, mode, "triton"),
        "made_up": lambda: scenario_made_up(hd64, mode),
        "made_up_eager": lambda: scenario_made_up(hd64, mode, enforce_eager=True),
        "unmeasured": lambda: scenario_unmeasured(hd64, mode),
        "bad_pin": lambda: scenario_bad_pin(hd64, mode),
    }
    results: dict[str, Any] = {"timings": {as_key(k): v for k, v in MADE_UP.items()}}
    with mode:
        for name, run in scenarios.items():
            decode_dispatch.clear()
            before = COUNTERS.as_dict()
            results[name] = run_one(mode, run)
            results[name]["counters"] = {k: v - before[k] for k, v in COUNTERS.as_dict().items()}
            results[name]["runtime"] = {
                "graph_captures": runtime.LOG.graph_captures,
                "graph_replays": runtime.LOG.graph_replays,
            }
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
