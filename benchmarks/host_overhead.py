#!/usr/bin/env python
"""Host time per decode step, and device kernels per decoder layer, of the engine as served on
a GPU, measured on a CPU-only machine through the fake-CUDA rig (tests/fake_cuda).

On an H200 a decode step's GPU work is shorter than the host's. This runs the serving loop's
own `Engine.step_delta()` on a random-weight Llama of SmolLM2-135M's shape (bf16, CUDA graphs
on, as served) with B requests all decoding (ignore_eos; the sampled token made up, as in the
rig's scenarios) and times windows of N steps in this thread's CPU time; medians reported.

Host time means what a real GPU would see: the rig's share is taken off (its own work,
mode.RigClock, and each op's trip into the Python dispatch mode and back, calibrated at start
on a mix of ops whose spread gives the low-high column) and a nominal launch cost
(LAUNCH_US) added back per device op and graph replay. `--phases` splits the corrected time
among the step's parts. Kernels per layer are counted on an eager pure-decode step: the ops
in the decoder layers' forward that would launch a kernel (tests/fake_cuda/launches.py) /
layers.

With `--async-scheduling on|both` the engine launches step n+1 before it reads step n's
tokens (engine/async_step.py); each row also gives the host ms from a step's token read to
the next launch (what the GPU idles per step; 0 when the launch comes first) and by how much
the launch came first. Not measured: the GPU's time, device waits, detokenizing (served
workers have no tokenizer, as here), the worker's delivery, the HTTP / gRPC side.

    .venv/bin/python benchmarks/host_overhead.py
    .venv/bin/python benchmarks/host_overhead.py --batches 256 --phases
    .venv/bin/python benchmarks/host_overhead.py --json --shape tiny --layers 2 --batches 1,4
    .venv/bin/python benchmarks/host_overhead.py --async-scheduling both --batches 1,64,256
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fake_cuda: the rig

import pytest
from tests.fake_cuda import kernels, launches, runtime
from tests.fake_cuda.calibration import Calibration, calibrate
from tests.fake_cuda.mode import FakeCudaMode
from tests.fake_cuda.scenarios import fake_sampling, make_engine, patch_loading, write_model
from tests.fake_cuda.timeline import Timeline, watch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine

# Host time of one torch op on CUDA tensors (binding, dispatcher, allocator, cudaLaunchKernel),
# charged per device op and graph replay in place of the fake dispatch: a few us to launch
# (NVIDIA's blog "Getting Started with CUDA Graphs", 2019) plus PyTorch's eager path (PyTorch's
# blog "Accelerating PyTorch with CUDA Graphs", 2021: several us); 5 us is the usual round
# figure. Views and allocations, which launch nothing, are charged it too: it errs high.
LAUNCH_US = 5.0
TARGET_MS = {256: 1.5}  # host ms per step (the target on a 2-core machine)
PROMPT_TOKENS = 16
# --api: the step timed (served: step_delta; step builds a cumulative output per request).
STEP_METHOD = {"delta": "step_delta", "cumulative": "step"}
MAX_MODEL_LEN = 1024
WARM_STEPS = 2  # decode steps after the prefill before timing (first replays, staging)
SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M: the default model's shape, and the GPU check's.
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "tie_word_embeddings": True,
    },
    # The rig's small Llama (scenarios.write_model's default): for tests of this script.
    "tiny": {"num_hidden_layers": 2},
}  # fmt: skip


@dataclass
class Rig:
    """Fake CUDA installed in this process, with its clock and launch counter."""

    mode: FakeCudaMode
    counter: launches.LaunchCounter
    calibration: Calibration


@dataclass
class Window:
    """N timed steps, in this thread's CPU time."""

    steps: int
    cpu_s: float
    rig_s: float  # CPU time in the rig's spans (mode.RigClock)
    host_dispatches: int
    device_dispatches: int
    device_ops: int  # launches.Launches.device_ops: what a GPU run would call too
    uploads: int
    replays: int
    # Host seconds from each step's token read to the next step's launch (timeline.py):
    # positive, the device idles; negative, the next step was launched before the read.
    gaps: list[float] = field(default_factory=list)

    def rig_cpu_s(self, cal: Calibration, device_s: float | None = None) -> float:
        """The rig's share: its spans, and each dispatch's cost outside them."""
        device = cal.device_s if device_s is None else device_s
        return self.rig_s + cal.host_s * self.host_dispatches + device * self.device_dispatches

    def corrected_s(self, cal: Calibration, device_s: float | None = None) -> float:
        """The host's own CPU time, plus a real launch for each device call."""
        launches = LAUNCH_US * 1e-6 * (self.device_ops + self.replays)
        return self.cpu_s - self.rig_cpu_s(cal, device_s) + launches


@dataclass
class Row:
    batch: int
    host_ms_per_step: float  # corrected (see the top), median of the windows
    kernels_per_layer: float  # eager pure-decode step
    host_ms_low: float  # corrected with the calibration mix's dearest op (and cheapest: high)
    host_ms_high: float
    raw_host_ms_per_step: float  # CPU time of the thread running the steps
    rig_ms_per_step: float  # subtracted: fake dispatch, stand-ins, dispatch-mode trips
    device_ops_per_step: float  # graphed step: every device call, a launch charged for each
    uploads_per_step: float
    graph_replays_per_step: float
    eager_kernels_per_step: int  # the whole eager step: layers, embedding, logits, sampler
    eager_device_ops_per_step: int
    async_scheduling: bool  # step n+1 launched before step n's tokens are read
    # Host ms from a step's token read to the next launch (the median; 0 when the launch
    # comes first): what the GPU idles per step were its steps instantaneous. The host
    # work per step (host_ms_per_step) is hidden behind a GPU step at least as long when
    # the launch comes first (async scheduling), and adds to it when not.
    idle_ms_per_step: float
    # Async scheduling: how long before step n's read step n+1 was launched (the median):
    # the host work done while the device computes.
    launch_lead_ms: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    # fmt: off
    add("--batches", type=_ints, default=[1, 64, 256],
        help="decoding requests per step, comma-separated (default 1,64,256)")
    add("--steps", type=int, default=20, help="decode steps per timed window")
    add("--windows", type=int, default=5, help="timed windows (medians)")
    add("--shape", choices=sorted(SHAPES), default="smollm2-135m",
        help="the random Llama's shape (tiny: for tests)")
    add("--layers", type=int, help="decoder layers (default: the shape's, 30 for SmolLM2-135M)")
    add("--phases", action="store_true", help="after the windows at the largest batch, time "
        "the step's parts (host time, the rig excluded) and print them to stderr")
    add("--api", choices=["delta", "cumulative"], default="delta",
        help="Engine.step_delta (served: new tokens only) or Engine.step (cumulative outputs)")
    add("--async-scheduling", choices=["off", "on", "both"], default="off",
        help="time the engine with async scheduling off (as earlier results), on (as served "
        "on CUDA), or both, window by window in interleaved pairs")
    add("--json", action="store_true",
        help='print [{"batch", "host_ms_per_step", "kernels_per_layer", ...}]')
    # fmt: on
    args = parser.parse_args(argv)
    if args.steps < 1 or args.windows < 1 or min(args.batches) < 1:
        parser.error("--steps, --windows and every batch must be >= 1")
    if PROMPT_TOKENS + WARM_STEPS + (args.windows + 1) * args.steps + 8 > MAX_MODEL_LEN:
        parser.error(f"--steps x --windows must stay within a {MAX_MODEL_LEN}-token context")
    return args


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def install_rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    mode = FakeCudaMode()
    runtime.install(monkeypatch, mode)
    launches.wrap_stand_ins(monkeypatch, mode)
    kernels.install(monkeypatch)
    patch_loading(monkeypatch)
    # cuda_backend checks the KV tensor's alignment through data_ptr: fake tensors warn.
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    return Rig(mode, launches.LaunchCounter(mode), calibrate(mode))


def start_decoding(engine: Engine, batch: int, tag: str) -> list[str]:
    """`batch` requests past prefill and a few decode steps (pure decodes from now): their ids."""
    vocab = engine.config.model_config.vocab_size
    max_tokens = MAX_MODEL_LEN - PROMPT_TOKENS - 1  # none finishes while measured
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [f"{tag}{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        # Distinct prompts: no prefix-cache sharing between them.
        prompt = [3 + (i * PROMPT_TOKENS + j) % (vocab - 3) for j in range(PROMPT_TOKENS)]
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    for _ in range(batch * PROMPT_TOKENS + 1):  # at worst one token per step
        started.update(out.request_id for out in engine.step())
        if len(started) == batch:
            break
    for _ in range(WARM_STEPS):
        engine.step()
    return ids


def stop(engine: Engine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort(request_id)  # frees their blocks: the next batch starts on an empty cache


def measure_window(engine: Engine, rig: Rig, steps: int, api: str = "delta") -> Window:
    mode = rig.mode
    clock, replays = mode.clock.seconds, runtime.LOG.graph_replays
    host, device = mode.host_dispatches, mode.device_dispatches
    # No collection inside: the rig's many short-lived objects would trigger collections a
    # run on a GPU does not make (the engine's own garbage is collected between windows).
    step = getattr(engine, STEP_METHOD[api])
    timeline = Timeline.of(engine, host_clock(rig))
    restore = watch(engine, timeline)
    gc.collect()
    gc.disable()
    try:
        with rig.counter.counting() as counted:
            cpu = time.thread_time()
            for _ in range(steps):
                step()
            cpu = time.thread_time() - cpu
    finally:
        gc.enable()
        restore()
    window = Window(
        steps=steps,
        cpu_s=cpu,
        rig_s=mode.clock.seconds - clock,
        host_dispatches=mode.host_dispatches - host,
        device_dispatches=mode.device_dispatches - device,
        device_ops=counted.device_ops,
        uploads=counted.uploads,
        replays=runtime.LOG.graph_replays - replays,
        gaps=timeline.gaps(),
    )
    if window.replays != steps:  # else this is not the served decode step
        raise RuntimeError(f"{window.replays} graph replays in {steps} decode steps")
    return window


def eager_launches(engine: Engine, rig: Rig, batch: int) -> tuple[float, launches.Launches]:
    """Kernels per decoder layer of one eager pure-decode step of `batch` rows; its launches."""
    ids = start_decoding(engine, batch, "eager")
    layers = engine.runner.model.layers  # type: ignore[attr-defined]
    with rig.counter.counting() as step, launches.counting_layers(rig.counter, layers) as inside:
        engine.step()
    stop(engine, ids)
    others = {launches.STAND_IN + "triton", launches.STAND_IN + "copy_blocks"} & set(step.kernels)
    if step.kernels[launches.STAND_IN + "decode"] != len(layers) or others:
        raise RuntimeError(f"not a pure decode step: {dict(step.kernels)}")
    return inside.num_kernels / len(layers), step


def measure(args: argparse.Namespace, rig: Rig, model: Path) -> list[Row]:
    largest = max(args.batches)
    common: dict[str, Any] = {
        "kv_cache_memory": None,
        "num_blocks": largest * -(-MAX_MODEL_LEN // 16) + 16,  # fake: costs no memory
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": largest,  # graphs up to the largest batch, as a server sized for it
        "max_num_batched_tokens": max(2048, largest),
    }
    flags = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    progress("engines with CUDA graphs (each captures each padded batch size)")
    graphed = {flag: make_engine(model, async_scheduling=flag, **common) for flag in flags}
    progress("engine without (enforce_eager)")
    eager = make_engine(model, enforce_eager=True, async_scheduling=False, **common)
    for engine in (*graphed.values(), eager):
        fake_sampling(engine)
    rows = []
    with rig.mode.strict_rules():  # the hot loop's rules: a step that breaks one raises
        for batch in args.batches:
            progress(f"batch {batch}: kernels per layer (eager)")
            per_layer, eager_step = eager_launches(eager, rig, batch)
            progress(f"batch {batch}: prefill, then {args.windows} x {args.steps} decode steps")
            ids = {flag: start_decoding(e, batch, "graphed") for flag, e in graphed.items()}
            windows: dict[bool, list[Window]] = {flag: [] for flag in flags}
            for i in range(args.windows):  # modes interleaved: each pair under the same load
                for flag, engine in graphed.items():
                    windows[flag].append(measure_window(engine, rig, args.steps, args.api))
                    ms = windows[flag][-1].corrected_s(rig.calibration) * 1e3 / args.steps
                    mode = "async" if flag else "sync"
                    progress(f"batch {batch}: window {i + 1} {mode}: {ms:.3f} ms per step")
            for flag, engine in graphed.items():
                if args.phases and batch == largest:
                    phases(engine, rig, args.steps * args.windows, args.api)
                stop(engine, ids[flag])
                cal = rig.calibration
                rows.append(summarize(batch, windows[flag], cal, per_layer, eager_step, flag))
    return rows


def summarize(
    batch: int,
    windows: list[Window],
    cal: Calibration,
    per_layer: float,
    eager: launches.Launches,
    async_scheduling: bool = False,
) -> Row:
    def per_step(value: Callable[[Window], float]) -> float:
        return statistics.median(value(w) / w.steps for w in windows)

    gaps = [gap for w in windows for gap in w.gaps]
    lead = [-gap for gap in gaps if gap < 0]

    return Row(
        batch=batch,
        host_ms_per_step=per_step(lambda w: w.corrected_s(cal) * 1e3),
        kernels_per_layer=per_layer,
        host_ms_low=per_step(lambda w: w.corrected_s(cal, cal.device_high_s) * 1e3),
        host_ms_high=per_step(lambda w: w.corrected_s(cal, cal.device_low_s) * 1e3),
        raw_host_ms_per_step=per_step(lambda w: w.cpu_s * 1e3),
        rig_ms_per_step=per_step(lambda w: w.rig_cpu_s(cal) * 1e3),
        device_ops_per_step=per_step(lambda w: w.device_ops),
        uploads_per_step=per_step(lambda w: w.uploads),
        graph_replays_per_step=per_step(lambda w: w.replays),
        eager_kernels_per_step=eager.num_kernels,
        eager_device_ops_per_step=eager.device_ops,
        async_scheduling=async_scheduling,
        idle_ms_per_step=max(0.0, statistics.median(gaps)) * 1e3 if gaps else 0.0,
        launch_lead_ms=statistics.median(lead) * 1e3 if lead else 0.0,
    )


def host_clock(rig: Rig) -> Callable[[], float]:
    """A clock of the host's own work: this thread's CPU time, stopped in the rig's spans and
    set back by each dispatch's calibrated trip."""
    mode, cal = rig.mode, rig.calibration

    def now() -> float:
        trips = cal.host_s * mode.host_dispatches + cal.device_s * mode.device_dispatches
        return time.thread_time() - mode.clock.elapsed() - trips

    return now


def phases(engine: Engine, rig: Rig, steps: int, api: str = "delta") -> None:
    """Where a decode step's host time goes, to stderr: `steps` more steps with the step's
    parts timed on `host_clock` (batch-level calls only, so the timing costs ~20 us a step).
    Nested parts are indented; "other" is a part's time outside the parts listed in it."""
    clock = host_clock(rig)
    spent: dict[str, float] = collections.defaultdict(float)  # host seconds by part
    calls: dict[str, int] = collections.defaultdict(int)  # device ops by part
    parts = phase_parts(engine, api)

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with rig.counter.counting() as launched:
                start = clock()
                try:
                    return function(*args, **kwargs)
                finally:
                    spent[name] += clock() - start
                    calls[name] += launched.device_ops

        return call

    with pytest.MonkeyPatch.context() as patch:
        for name, (owner, attribute) in parts.items():
            patch.setattr(owner, attribute, timed(name, getattr(owner, attribute)))
        gc.collect()
        gc.disable()
        try:
            step = getattr(engine, STEP_METHOD[api])
            for _ in range(steps):
                step()
        finally:
            gc.enable()
    print_parts(list(parts), spent, calls, steps)


def phase_parts(engine: Engine, api: str) -> dict[str, tuple[Any, str]]:
    """The step's parts `phases` times (see `parts` below)."""
    from kvrelay.engine import engine as engine_module
    from kvrelay.engine import runner as runner_module

    runner, scheduler, overlap = engine.runner, engine.scheduler, engine.overlap
    # Async scheduling: the step launches the next batch (`_launch` runs `_execute`), reads
    # the one in flight, counts the launched chunks computed after the outputs.
    run = "step.execute" if overlap is None else "step.launch.execute"
    parts = {  # name: (object, attribute); the name's dots say what it is inside of
        "step": (engine, STEP_METHOD[api]),
        "step.expire_leases": (engine.handoff, "expire_leases"),
        "step.schedule": (scheduler, "schedule"),
        **({} if overlap is None else {"step.launch": (overlap, "_launch")}),
        run: (engine, "_execute"),
        # A pure decode step (what is timed here) takes the runner's decode path.
        f"{run}.runner": (runner, "execute_decodes"),
        f"{run}.runner.upload": (runner.uploader, "upload_decodes"),
        f"{run}.runner.replay": (runner.graphs, "replay"),
        f"{run}.runner.compute_logits": (runner.model, "compute_logits"),
        f"{run}.runner.sample": (runner_module, "sample_isolating"),
        f"{run}.runner.sample_on_device": (runner.sampler, "sample_on_device"),
    }
    if overlap is None:
        parts["step.execute.update_after_step"] = (scheduler, "update_after_step")
    else:
        parts["step.read"] = (overlap, "_read")
    parts["step.append_sampled"] = (engine_module, "append_sampled")
    if overlap is not None:
        parts["step.after_outputs"] = (overlap, "after_outputs")
        parts["step.after_outputs.update_after_step"] = (scheduler, "update_after_step")
    return parts


def print_parts(
    names: list[str], spent: dict[str, float], calls: dict[str, int], steps: int
) -> None:
    """`phases`' table: each part's own ms per step, device ops, and the two together."""
    progress(f"host ms/step by part, {steps} steps: own, device ops, +{LAUNCH_US:g} us per op")
    for name in names:
        depth = name.count(".")
        inside = [n for n in names if n.startswith(name + ".") and n.count(".") == depth + 1]
        rows = [(name.rsplit(".", 1)[-1], depth, spent[name], calls[name])]
        if inside:
            other = (spent[name] - sum(spent[n] for n in inside),
                     calls[name] - sum(calls[n] for n in inside))  # fmt: skip
            rows.append(("(other)", depth + 1, *other))
        for label, indent, seconds, count in rows:
            ms, ops = seconds * 1e3 / steps, count / steps
            total = ms + ops * LAUNCH_US / 1e3
            progress(f"{'  ' * indent}{label:<{36 - 2 * indent}}{ms:8.3f}{ops:7.1f}{total:8.3f}")


def table(rows: list[Row], cal: Calibration) -> str:
    lines = [
        "Host CPU ms per decode step (CUDA graphs on): raw, and corrected = raw - the rig's "
        f"share + {LAUNCH_US:g} us per device op and graph replay. The rig's dispatch costs "
        f"{cal.host_s * 1e6:.1f} us per host op and {cal.device_s * 1e6:.1f} us per device op "
        f"(range {cal.device_low_s * 1e6:.1f}-{cal.device_high_s * 1e6:.1f}: the low-high "
        "column) outside its timed spans. Kernels per layer: an eager pure-decode step.",
        "",
        "Idle ms: from a step's token read to the next launch (0: launched before the read, "
        "async scheduling; lead ms: by how much).",
        "",
        "| batch | async | host ms/step | low-high | target | idle ms | lead ms | raw ms/step "
        "| rig ms/step | device ops/step | kernels/layer | eager kernels/step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        target = f"<= {TARGET_MS[r.batch]:g}" if r.batch in TARGET_MS else "-"
        lines.append(
            f"| {r.batch} | {'on' if r.async_scheduling else 'off'} | {r.host_ms_per_step:.3f} "
            f"| {r.host_ms_low:.2f}-{r.host_ms_high:.2f} | {target} | {r.idle_ms_per_step:.3f} "
            f"| {r.launch_lead_ms:.3f} | {r.raw_host_ms_per_step:.2f} | {r.rig_ms_per_step:.2f} "
            f"| {r.device_ops_per_step:g} | {r.kernels_per_layer:g} "
            f"| {r.eager_kernels_per_step} |"
        )
    return "\n".join(lines)


def _write(shape: str, layers: int | None, folder: Path) -> Path:
    fields = {**SHAPES[shape], **({} if layers is None else {"num_hidden_layers": layers})}
    return write_model(folder / shape, int(fields.pop("head_dim", 64)), **fields)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    monkeypatch = pytest.MonkeyPatch()
    try:
        rig = install_rig(monkeypatch)
        trips = rig.calibration.host_s * 1e6, rig.calibration.device_s * 1e6
        progress("rig trips: {:.1f} us a host op, {:.1f} us a device op".format(*trips))
        with tempfile.TemporaryDirectory(prefix="host-overhead-") as folder:
            progress(f"writing a random {args.shape} Llama")
            model = _write(args.shape, args.layers, Path(folder))
            with rig.mode:
                rows = measure(args, rig, model)
    finally:
        monkeypatch.undo()
    for row in rows:
        if not all(math.isfinite(v) for v in asdict(row).values()):
            raise RuntimeError(f"a figure is not finite: {row}")
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
    else:
        print(table(rows, rig.calibration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
