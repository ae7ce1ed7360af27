"""Part 3's decode-step measurements: wall time per pure-decode step against the device's busy
time in the same steps (how much of a step the GPU waits on the host), the step-time targets,
and kernels per decoder layer of an eager step (what fusion work has left to merge).

Wall time is the host clock around `engine.step_delta()` (the served step: new tokens as rows,
not cumulative outputs; each step ends with the engine's one host sync for the sampled tokens),
median of steady-state steps. Device time is the union of the
CUDA activities torch.profiler (CUPTI) records in separate steps, divided by their number: a
profiled step runs slower on the host, but its kernels take what they take.

On CUDA the engine schedules asynchronously by default (engine/async_step.py: step n+1 is
launched before step n's tokens are read), which is what the "graphs" rows time; each graphed
batch is timed again on the same engine with async scheduling held aside ("graphs, async
off"), so one run shows what the overlap hides.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpu_parts.engine_models import (
    build_model,
    free_device_memory,
    greedy,
    make_engine,
    model_key,
    prompts_of,
)
from gpu_parts.profile_events import (
    LayerKernels,
    busy_us,
    cpu_op_counts,
    device_events,
    kernel_counts,
    per_layer,
    short_name,
)
from gpu_parts.report import MISS, PASS, SKIP, Context, Deadline, Row, last_line

PART = "3 engine"
STEP_TARGET_MS = {"135M": 0.6, "1B": 1.0}  # graphed decode step at batch 1
HOST_RATIO = 1.1  # graphed 135M steps at batch >= HOST_MIN_BATCH: wall <= 1.1 x device busy
HOST_MIN_BATCH = 16
HOST_LABELS = ("135M",)
KERNELS_PER_LAYER_TARGET = 10.0
BATCHES = {True: (1, 4), False: (1, 16, 64, 256)}  # by ctx.small


def start_decoding(engine: Any, batch: int, vocab: int, max_tokens: int) -> list[str]:
    """Add `batch` requests and step until every one has decoded once (prefills done): from
    then on each step is a pure decode step of `batch` sequences. Returns their ids."""
    ids = [f"step{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts_of([32] * batch, vocab, seed=batch), strict=True):
        engine.add_request(rid, prompt, greedy(max_tokens))
    decoded: dict[str, int] = {}
    for _ in range(10_000):  # prefills first (chunked), then one decode step each
        for output in engine.step():
            decoded[output.request_id] = len(output.outputs[0].token_ids)
        if len(decoded) == batch and min(decoded.values()) >= 2:
            break
    return ids


def stop_decoding(engine: Any, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def profile_steps(engine: Any, steps: int, cuda: bool) -> list[Any]:
    """torch.profiler's events over `steps` engine steps (CUDA activities where `cuda`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step_delta()
        if cuda:
            torch.cuda.synchronize()
    return list(prof.events())


@dataclass(frozen=True)
class StepTime:
    wall_ms: float  # median host time of one step
    gpu_ms: float | None  # device busy time per step; None: no device activity recorded


def step_time(
    engine: Any, batch: int, vocab: int, steps: int, profiled: int, cuda: bool
) -> StepTime:
    """Wall and (over `profiled` further steps, when > 0) device time of a pure-decode step
    with `batch` running sequences."""
    ids = start_decoding(engine, batch, vocab, steps + profiled + 64)
    try:
        for _ in range(3):  # past the first decode steps
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step_delta()
            times.append(time.perf_counter() - start)
        gpu_ms = None
        if profiled:
            try:
                events = device_events(profile_steps(engine, profiled, cuda))
            except Exception as exc:  # no CUPTI: the wall time still stands
                print(f"profiler unavailable: {last_line(exc)}", flush=True)
                events = []
            gpu_ms = busy_us(events) / profiled / 1e3 if events else None
    finally:
        stop_decoding(engine, ids)
    return StepTime(statistics.median(times) * 1e3, gpu_ms)


@contextlib.contextmanager
def synchronous(engine: Any) -> Iterator[bool]:
    """`engine` with its async scheduling held aside (engine/async_step.py), for a synchronous
    run on the same engine (same graphs, same KV): between runs only, nothing in flight.
    Yields whether there was async scheduling to hold aside."""
    overlap = getattr(engine, "overlap", None)
    if overlap is None:
        yield False
        return
    overlap.drain()
    engine.overlap = engine.scheduler.fence = None
    try:
        yield True
    finally:
        engine.overlap = engine.scheduler.fence = overlap


def step_ms(engine: Any, batch: int, vocab: int, steps: int) -> float:
    """Median wall time of a pure-decode step with `batch` running sequences."""
    return step_time(engine, batch, vocab, steps, 0, False).wall_ms


def step_row(label: str, mode: str, batch: int, t: StepTime, cuda: bool) -> Row:
    """One step's row: the batch-1 step-time target (graphs), and host vs device at batch >=
    HOST_MIN_BATCH (graphed 135M). Targets are judged on a GPU only."""
    check = f"{label} decode step, {mode}, batch {batch}"
    value = f"wall {t.wall_ms:.3f} ms"
    if t.gpu_ms is not None:
        value += f", GPU {t.gpu_ms:.3f} ms = {t.wall_ms / t.gpu_ms:.2f}x"
    graphs = mode == "graphs"
    if graphs and batch == 1 and label in STEP_TARGET_MS:
        limit = STEP_TARGET_MS[label]
        target, ok = f"<= {limit} ms", t.wall_ms <= limit
    elif graphs and batch >= HOST_MIN_BATCH and label in HOST_LABELS:
        target = f"wall <= {HOST_RATIO}x GPU"
        if cuda and t.gpu_ms is None:
            return Row(PART, check, SKIP, value, target, "n/a: the profiler saw no device work")
        ok = t.gpu_ms is not None and t.wall_ms <= HOST_RATIO * t.gpu_ms
    else:
        return Row(PART, check, PASS, value)
    if not cuda:
        return Row(PART, check, PASS, value, target, "target applies on a GPU")
    return Row(PART, check, PASS if ok else MISS, value, target)


def step_rows(
    ctx: Context, deadline: Deadline, label: str, engine: Any, vocab: int, mode: str
) -> list[Row]:
    """Step rows at batch 1/16/64/256; graphed steps are profiled for their device time too."""
    rows = []
    profiled = (3 if ctx.small else 10) if mode == "graphs" else 0
    for batch in BATCHES[ctx.small]:
        if deadline.expired():
            rows.append(Row(PART, f"{label} decode step, {mode}, batch {batch}", SKIP,
                            note="time budget"))  # fmt: skip
            continue
        timed = 5 if ctx.small else 30
        t = step_time(engine, batch, vocab, timed, profiled, ctx.cuda)
        rows.append(step_row(label, mode, batch, t, ctx.cuda))
        ctx.shared[f"step:{label}:{mode}:{batch}"] = t.wall_ms
        if mode != "graphs" or deadline.expired():
            continue
        with synchronous(engine) as held:
            if held:  # the same steps without the overlap: what it hides
                t = step_time(engine, batch, vocab, timed, profiled, ctx.cuda)
                rows.append(step_row(label, "graphs, async off", batch, t, ctx.cuda))
    return rows


def decode_step_counts(
    engine: Any, vocab: int, cuda: bool, steps: int = 2
) -> tuple[dict[str, float], str]:
    """Per-step launches by kernel name over `steps` pure-decode steps of 4 sequences, and
    what was counted: CUDA kernels, or (no CUDA activity: a CPU run) top-level aten ops."""
    ids = start_decoding(engine, 4, vocab, steps + 64)
    try:
        engine.step()
        events = profile_steps(engine, steps, cuda)
    finally:
        stop_decoding(engine, ids)
    counts: Counter[str] = kernel_counts(device_events(events))
    what = "CUDA kernels"
    if not counts:
        counts, what = cpu_op_counts(events), "CPU ops"
    return {name: n / steps for name, n in counts.items()}, what


def layers_row(label: str, layers: LayerKernels, what: str, cuda: bool) -> Row:
    check = f"{label} kernels per decoder layer (eager decode step)"
    value = f"{layers.per_layer:.1f} {what} per layer, {layers.outside:.0f} outside the layers"
    top = ", ".join(f"{short_name(n, 44)} x{c:g}" for n, c in layers.top[:4])
    target = f"<= {KERNELS_PER_LAYER_TARGET:.0f}"
    if not cuda or what != "CUDA kernels":
        why = "no CUDA device: counted CPU ops" if not cuda else "n/a: no CUDA kernel recorded"
        return Row(PART, check, SKIP, value, target, why)
    status = PASS if layers.per_layer <= KERNELS_PER_LAYER_TARGET else MISS
    return Row(PART, check, status, value, target, top)


def kernels_per_layer_row(
    ctx: Context, label: str, name: str, deep_engine: Any, deep_layers: int, vocab: int
) -> Row:
    """Kernels per layer of an eager pure-decode step of `deep_engine` (module docstring),
    against the same shape built a few layers deep; the per-kernel list goes to the log and
    $OUT/kernels_per_layer.md."""
    shallow_layers = 1 if deep_layers < 4 else 2
    try:
        deep, what = decode_step_counts(deep_engine, vocab, ctx.cuda)
        folder, _ = build_model(ctx, name, layers=shallow_layers)
        engine = make_engine(ctx, folder, eager=True, max_num_seqs=8,
                             kv_cache_memory="16MiB" if ctx.small else "1GiB")  # fmt: skip
        try:
            shallow, _ = decode_step_counts(engine, vocab, ctx.cuda)
        finally:
            del engine
            ctx.shared.pop(model_key(ctx, name, None, shallow_layers), None)
            free_device_memory()
        layers = per_layer(deep, deep_layers, shallow, shallow_layers, top=12)
    except Exception as exc:  # no CUPTI, no enforce_eager, ...: the other rows still stand
        check = f"{label} kernels per decoder layer (eager decode step)"
        return Row(PART, check, SKIP, note=f"n/a: {last_line(exc)}")
    detail = "\n".join(f"{c:6.2f}  {short_name(n, 120)}" for n, c in layers.top)
    ctx.log(f"{label}: {what} per decoder layer ({layers.per_layer:.1f}), most first:\n{detail}")
    if ctx.out_dir is not None:
        (ctx.out_dir / "kernels_per_layer.md").write_text(
            f"{label}, eager decode step of 4 sequences: {layers.per_layer:.1f} {what} per "
            f"layer, {layers.outside:.0f} outside the layers\n\n```\n{detail}\n```\n"
        )
    return layers_row(label, layers, what, ctx.cuda)
