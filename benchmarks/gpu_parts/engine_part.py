"""Part 3: the engine end to end on the device with random-weight models built on the spot
(the default model's shape, and a ~1B Llama with head_dim 128):

- exactness: in fp32, TF32 off, greedy tokens EQUAL to transformers' `generate` on the same
  weights, with graphs and --enforce-eager (engine_exact.py);
- the kernel counters (and the profiler's own view) proving the CUDA decode kernel and CUDA
  graphs ran; eager tokens equal to graphed ones (bf16: a parting only at a near-tie);
- decode steps at batch 1/16/64/256 with graphs on and off: wall time, and with graphs the
  device's busy time per step (host overhead = their gap); kernels per decoder layer of an
  eager step (engine_steps.py);
- throughput at 256 concurrent requests against transformers' static batching and its
  continuous batching, `generate_batch` (engine_throughput.py);
- no Triton JIT compile after an engine said it was ready (COUNTERS.jit_compiles_after_ready).
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from typing import Any

from gpu_parts.engine_exact import exact_rows
from gpu_parts.engine_models import (
    build_model,
    counter_delta,
    counters,
    engine_args_fields,
    engine_generate,
    free_device_memory,
    logit_gap,
    make_engine,
    prompts_of,
)
from gpu_parts.engine_steps import (
    kernels_per_layer_row,
    start_decoding,
    step_ms,
    step_rows,
    stop_decoding,
)
from gpu_parts.engine_throughput import throughput_rows
from gpu_parts.report import FAIL, PASS, SKIP, Context, Deadline, Row, last_line

PART = "3 engine"
SMOL, BIG = "smollm2-135m", "llama-1b-hd128"
# Eager may part from graphed tokens (both kvrelay's, bf16) only where transformers' own top
# two logits are this close: split-K partitions may differ between the two (fp32 on the CPU:
# far closer). Exactness against transformers is engine_exact's fp32 check, with no allowance.
TIE_GAP = {True: 0.15, False: 1e-3}  # by ctx.cuda
__all__ = ["run", "step_ms"]  # step_ms: the step timing, re-exported for the tests


def compare_greedy(
    ctx: Context,
    check: str,
    hf: Any,
    prompts: list[list[int]],
    ours: list[list[int]],
    theirs: list[list[int]],
) -> Row:
    """`ours` equal to `theirs` token for token, or parted at a near-tie of transformers' own
    next-token logits (`theirs` being the reference's choice there)."""
    exact, ties, worst = 0, 0, 0.0
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        if a == b:
            exact += 1
            continue
        at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        gap = abs(logit_gap(hf, prompt + b[:at], b[at], a[at]))
        worst = max(worst, gap)
        if gap > TIE_GAP[ctx.cuda]:
            note = (
                f"prompt of {len(prompt)}: token {at} is {a[at]}, reference {b[at]} "
                f"(logit gap {gap:.3f}: not a tie)"
            )
            return Row(PART, check, FAIL, f"{exact}/{len(prompts)} equal", "equal", note)
        ties += 1
    note = f"{ties} parted at a near-tie (gap <= {worst:.3f})" if ties else ""
    return Row(PART, check, PASS, f"{exact}/{len(prompts)} equal", "equal", note)


def counter_rows(label: str, delta: dict[str, int], cuda: bool) -> list[Row]:
    kernel, graphs = f"{label}: a decode attention kernel ran", f"{label}: CUDA graphs replayed"
    if not cuda:
        return [
            Row(PART, kernel, SKIP, note="no CUDA device"),
            Row(PART, graphs, SKIP, note="no CUDA device"),
        ]
    if not delta:
        note = "n/a: kvrelay_kernels has no counters in this checkout"
        return [Row(PART, kernel, SKIP, note=note), Row(PART, graphs, SKIP, note=note)]
    # The decode dispatch gives each step to the CUDA kernel or Triton's decode entry,
    # whichever it timed faster for the shape at load: either one running is a pass.
    cuda, triton = delta.get("cuda_decode_calls", 0), delta.get("triton_decode_calls", 0)
    value = f"cuda_decode_calls +{cuda}, triton_decode_calls +{triton}"
    rows = [Row(PART, kernel, PASS if cuda + triton > 0 else FAIL, value, "> 0")]
    if "enforce_eager" not in engine_args_fields() and delta.get("graph_replays", 0) == 0:
        rows.append(Row(PART, graphs, SKIP, note="n/a: this engine has no CUDA graphs yet"))
        return rows
    replays = delta.get("graph_replays", 0)
    value = (
        f"graph_replays +{replays}, captures +{delta.get('graph_captures', 0)}, "
        f"eager steps +{delta.get('eager_steps', 0)}"
    )
    rows.append(Row(PART, graphs, PASS if replays > 0 else FAIL, value, "> 0"))
    return rows


def profiler_row(label: str, engine: Any, vocab: int) -> Row:
    """What the GPU itself ran during 5 decode steps (torch.profiler / CUPTI), independent of
    kvrelay's own counters: kvrelay's decode kernel, and graph launches."""
    from torch.profiler import ProfilerActivity, profile

    check = f"{label}: profiler sees a decode attention kernel"
    ids = start_decoding(engine, 4, vocab, 64)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
        names = [event.key for event in prof.key_averages()]
        counts = {e.key: e.count for e in prof.key_averages()}
    except Exception as exc:  # no CUPTI here: the counters above still stand
        return Row(PART, check, SKIP, note=f"profiler unavailable: {last_line(exc)}")
    finally:
        stop_decoding(engine, ids)
    # CUDA's kernel is paged_decode*; Triton's decode entry launches _paged_attention_kernel.
    decode = sum(counts[n] for n in names if "paged_decode" in n)
    triton = sum(counts[n] for n in names if "_paged_attention_kernel" in n)
    graphs = sum(counts[n] for n in names if "GraphLaunch" in n)
    value = (
        f"paged_decode kernels {decode}, Triton attention kernels {triton}, "
        f"graph launches {graphs} in 5 steps"
    )
    return Row(PART, check, PASS if decode + triton > 0 else FAIL, value, "> 0")


@dataclass(frozen=True)
class Greedy:
    """One model's greedy run with CUDA graphs on: what the eager run must reproduce."""

    hf: Any
    prompts: list[list[int]]
    max_tokens: int
    graphed: list[list[int]]


def model_rows(ctx: Context, deadline: Deadline, name: str, label: str) -> list[Row]:
    """In the run's dtype (bf16 on a GPU): counters and step times with graphs on, for the
    135M shape the throughput comparison; then with graphs off: eager tokens equal to the
    graphed ones, step times, and for the 135M shape kernels per layer."""
    folder, hf = build_model(ctx, name)
    vocab = hf.config.vocab_size
    prompts = prompts_of([5, 17, 9] if ctx.small else [5, 17, 33, 64, 130], vocab, seed=3)
    max_tokens = 8 if ctx.small else 24
    memory = "64MiB" if ctx.small else "8GiB"
    before = counters()
    engine = make_engine(ctx, folder, eager=False, max_num_seqs=256, kv_cache_memory=memory)
    ours = engine_generate(engine, prompts, max_tokens)
    rows = counter_rows(label, counter_delta(before, counters()), ctx.cuda)
    if ctx.cuda and not deadline.expired():
        rows.append(profiler_row(label, engine, vocab))
    rows += step_rows(ctx, deadline, label, engine, vocab, "graphs")
    if name == SMOL and not deadline.expired():
        rows += throughput_rows(ctx, deadline, engine, hf, vocab)
    del engine
    free_device_memory()
    greedy_run = Greedy(hf, prompts, max_tokens, ours)
    rows += eager_rows(ctx, deadline, name, label, folder, memory, greedy_run)
    return rows


def eager_rows(
    ctx: Context,
    deadline: Deadline,
    name: str,
    label: str,
    folder: Any,
    memory: str,
    graphed: Greedy,
) -> list[Row]:
    """With --enforce-eager: the graphed run's greedy tokens again, step times, and for the
    135M shape the kernels per decoder layer."""
    check = f"{label}: eager tokens vs graphed (--enforce-eager)"
    if deadline.expired():
        return [Row(PART, check, SKIP, note="time budget")]
    try:
        engine = make_engine(ctx, folder, eager=True, max_num_seqs=256, kv_cache_memory=memory)
    except NotImplementedError as exc:
        return [Row(PART, check, SKIP, note=f"n/a: {exc}")]
    eager = engine_generate(engine, graphed.prompts, graphed.max_tokens)
    rows = [compare_greedy(ctx, check, graphed.hf, graphed.prompts, eager, graphed.graphed)]
    vocab = graphed.hf.config.vocab_size
    rows += step_rows(ctx, deadline, label, engine, vocab, "eager")
    if name == SMOL and not deadline.expired():
        layers = graphed.hf.config.num_hidden_layers
        rows.append(kernels_per_layer_row(ctx, label, name, engine, layers, vocab))
    del engine
    free_device_memory()
    return rows


def jit_row(now: dict[str, int] | None, cuda: bool, ready: bool | None) -> Row:
    """Triton compiles after an engine said it was ready (each one stalled a serving step):
    must be 0. n/a where the counter is missing, or nothing shows the hook counting (no
    compile at all, or no engine marked itself ready: `ready` False)."""
    check, target = "no Triton JIT compile after the engine was ready", "0"
    if now is None or "jit_compiles_after_ready" not in now:
        note = "n/a: COUNTERS has no jit_compiles_after_ready in this checkout"
        return Row(PART, check, SKIP, target=target, note=note)
    after, total = now["jit_compiles_after_ready"], now.get("jit_compiles", 0)
    value = f"{after} after ready ({total} compiles in all)"
    if not cuda:
        return Row(PART, check, SKIP, value, target, "no CUDA device: no Triton kernel compiled")
    if total == 0:
        note = "n/a: no compile counted (Triton's jit_cache_hook not installed?)"
        return Row(PART, check, SKIP, value, target, note)
    if ready is False:
        note = "n/a: no engine marked itself ready (jit_watch.warming_up unused)"
        return Row(PART, check, SKIP, value, target, note)
    return Row(PART, check, PASS if after == 0 else FAIL, value, target)


def engine_was_ready() -> bool | None:
    """Whether jit_watch saw an engine become ready (None: no way to tell here)."""
    try:
        module = importlib.import_module("kvrelay_kernels.jit_watch")
    except ImportError:
        return None
    state = getattr(module, "_state", None)
    return bool(state.get("ready")) if isinstance(state, dict) else None


def run(ctx: Context, deadline: Deadline) -> list[Row]:
    """fp32 exactness first (the correctness check), then each model in bf16, then the JIT
    counter over everything the part ran."""
    rows: list[Row] = []
    try:
        rows += exact_rows(ctx, deadline, SMOL, "135M")
    except Exception as exc:  # the models below still run
        traceback.print_exc()
        rows.append(Row(PART, "135M fp32 exactness", FAIL, note=last_line(exc)))
    for name, label in ((SMOL, "135M"), (BIG, "1B")):
        if deadline.expired():
            rows.append(Row(PART, f"{label} model", SKIP, note="time budget"))
            continue
        try:
            rows += model_rows(ctx, deadline, name, label)
        except Exception as exc:  # the other model still runs
            traceback.print_exc()
            rows.append(Row(PART, f"{label} model", FAIL, note=last_line(exc)))
        finally:
            if name == BIG:  # part 4 uses the 135M shape only
                ctx.shared.pop(f"model:{name}", None)
            free_device_memory()
    rows.append(jit_row(counters(), ctx.cuda, engine_was_ready()))
    return rows
