"""Part 3: the engine end to end on the device with random-weight models built on the spot
(the default model's shape, and a ~1B Llama with head_dim 128): greedy tokens against
transformers' `generate` on the same weights; the kernel counters proving the CUDA decode
kernel and CUDA graphs ran; decode step time at batch 1/32/128 with graphs on and off; and
throughput at 256 concurrent requests against transformers' static batching."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any

from gpu_parts.engine_models import (
    build_model,
    counter_delta,
    counters,
    engine_args_fields,
    engine_generate,
    free_device_memory,
    greedy,
    hf_generate,
    logit_gap,
    make_engine,
    prompts_of,
)
from gpu_parts.report import FAIL, MISS, PASS, SKIP, Context, Deadline, Row, last_line

PART = "3 engine"
SMOL, BIG = "smollm2-135m", "llama-1b-hd128"
# Greedy may part from transformers only where its own top two logits are this close: two
# correct bf16 implementations round differently (fp32 on the CPU: far closer).
TIE_GAP = {True: 0.15, False: 1e-3}  # by ctx.cuda
STEP_TARGET_MS = 3.0  # graphed decode step of the 135M shape at batch 1
THROUGHPUT_TARGET = 5.0  # x transformers' static batching


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
    kernel, graphs = f"{label}: CUDA decode kernel ran", f"{label}: CUDA graphs replayed"
    if not cuda:
        return [
            Row(PART, kernel, SKIP, note="no CUDA device"),
            Row(PART, graphs, SKIP, note="no CUDA device"),
        ]
    if not delta:
        note = "n/a: kvrelay_kernels has no counters in this checkout"
        return [Row(PART, kernel, SKIP, note=note), Row(PART, graphs, SKIP, note=note)]
    calls = delta.get("cuda_decode_calls", 0)
    rows = [Row(PART, kernel, PASS if calls > 0 else FAIL, f"cuda_decode_calls +{calls}", "> 0")]
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


def step_ms(engine: Any, batch: int, vocab: int, steps: int) -> float:
    """Median wall time of a pure-decode step with `batch` running sequences (each step ends
    with the engine's one host sync, for the sampled tokens)."""
    ids = start_decoding(engine, batch, vocab, steps + 64)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    stop_decoding(engine, ids)
    return statistics.median(times) * 1e3


def profiler_row(label: str, engine: Any, vocab: int) -> Row:
    """What the GPU itself ran during 5 decode steps (torch.profiler / CUPTI), independent of
    kvrelay's own counters: kvrelay's decode kernel, and graph launches."""
    from torch.profiler import ProfilerActivity, profile

    check = f"{label}: profiler sees the CUDA decode kernel"
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
    decode = sum(counts[n] for n in names if "paged_decode" in n)
    graphs = sum(counts[n] for n in names if "GraphLaunch" in n)
    value = f"paged_decode kernels {decode}, graph launches {graphs} in 5 steps"
    return Row(PART, check, PASS if decode > 0 else FAIL, value, "> 0")


def step_rows(
    ctx: Context, deadline: Deadline, label: str, engine: Any, vocab: int, mode: str
) -> list[Row]:
    rows = []
    for batch in (1, 4) if ctx.small else (1, 32, 128):
        check = f"{label} decode step, {mode}, batch {batch}"
        if deadline.expired():
            rows.append(Row(PART, check, SKIP, note="time budget"))
            continue
        ms = step_ms(engine, batch, vocab, 5 if ctx.small else 30)
        target, status = "", PASS
        if label == "135M" and mode == "graphs" and batch == 1 and ctx.cuda:
            target = f"< {STEP_TARGET_MS:.0f} ms"
            status = PASS if ms < STEP_TARGET_MS else MISS
        rows.append(Row(PART, check, status, f"{ms:.2f} ms", target))
        ctx.shared[f"step:{label}:{mode}:{batch}"] = ms
    return rows


def throughput_row(ctx: Context, engine: Any, hf: Any, vocab: int) -> Row:
    """Output tokens/s of 256 concurrent requests (64 in, 128 out) against one static batch
    of transformers' generate on the same prompts."""
    count, prompt_len, out_len = (8, 16, 8) if ctx.small else (256, 64, 128)
    prompts = prompts_of([prompt_len] * count, vocab, seed=11)
    engine_generate(engine, prompts[:4], 4)  # warm-up (compiles, first launches)
    start = time.perf_counter()
    engine_generate(engine, prompts, out_len)
    ours = count * out_len / (time.perf_counter() - start)
    hf_generate(hf, prompts[:2], 2)
    start = time.perf_counter()
    hf_generate(hf, prompts, out_len)
    theirs = count * out_len / (time.perf_counter() - start)
    ratio = ours / theirs
    check = f"135M throughput, {count} concurrent vs transformers static batch"
    value = f"{ours:.0f} vs {theirs:.0f} tok/s = {ratio:.1f}x"
    if not ctx.cuda:
        return Row(PART, check, PASS, value, note="target applies on a GPU")
    return Row(
        PART,
        check,
        PASS if ratio >= THROUGHPUT_TARGET else MISS,
        value,
        f">= {THROUGHPUT_TARGET:.0f}x",
    )


@dataclass(frozen=True)
class Greedy:
    """One model's greedy run with CUDA graphs on: what the eager run must reproduce."""

    hf: Any
    prompts: list[list[int]]
    max_tokens: int
    graphed: list[list[int]]


def model_rows(ctx: Context, deadline: Deadline, name: str, label: str) -> list[Row]:
    """Greedy equality, counters and step times (graphs on) for one model shape, and for the
    135M shape the throughput comparison; then the same with graphs off."""
    folder, hf = build_model(ctx, name)
    vocab = hf.config.vocab_size
    prompts = prompts_of([5, 17, 9] if ctx.small else [5, 17, 33, 64, 130], vocab, seed=3)
    max_tokens = 8 if ctx.small else 24
    memory = "64MiB" if ctx.small else "8GiB"
    before = counters()
    engine = make_engine(ctx, folder, eager=False, max_num_seqs=256, kv_cache_memory=memory)
    ours = engine_generate(engine, prompts, max_tokens)
    delta = counter_delta(before, counters())
    theirs = hf_generate(hf, prompts, max_tokens)
    check = f"{label}: greedy tokens vs transformers"
    rows = [compare_greedy(ctx, check, hf, prompts, ours, theirs)]
    rows += counter_rows(label, delta, ctx.cuda)
    if ctx.cuda and not deadline.expired():
        rows.append(profiler_row(label, engine, vocab))
    rows += step_rows(ctx, deadline, label, engine, vocab, "graphs")
    if name == SMOL and not deadline.expired():
        rows.append(throughput_row(ctx, engine, hf, vocab))
    del engine
    free_device_memory()
    greedy_run = Greedy(hf, prompts, max_tokens, ours)
    rows += eager_rows(ctx, deadline, label, folder, memory, greedy_run)
    return rows


def eager_rows(
    ctx: Context, deadline: Deadline, label: str, folder: Any, memory: str, graphed: Greedy
) -> list[Row]:
    """With --enforce-eager: the graphed run's greedy tokens again, and step times."""
    check = f"{label}: eager tokens vs graphed (--enforce-eager)"
    if deadline.expired():
        return [Row(PART, check, SKIP, note="time budget")]
    try:
        engine = make_engine(ctx, folder, eager=True, max_num_seqs=256, kv_cache_memory=memory)
    except NotImplementedError as exc:
        return [Row(PART, check, SKIP, note=f"n/a: {exc}")]
    eager = engine_generate(engine, graphed.prompts, graphed.max_tokens)
    rows = [compare_greedy(ctx, check, graphed.hf, graphed.prompts, eager, graphed.graphed)]
    rows += step_rows(ctx, deadline, label, engine, graphed.hf.config.vocab_size, "eager")
    del engine
    free_device_memory()
    return rows


def run(ctx: Context, deadline: Deadline) -> list[Row]:
    rows: list[Row] = []
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
    return rows
