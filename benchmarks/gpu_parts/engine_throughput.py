"""Part 3's throughput check: output tokens/s of 256 concurrent requests (128 in / 128 out) on
the 135M shape, kvrelay against two transformers peers on the same weights and prompts: its
static batching (`generate` on one padded batch) and its continuous batching
(`generate_batch`, transformers 5.x).

Each side is warmed up before it is timed, except `generate_batch`, which sets up (sizes its
paged cache, captures its graphs) inside the call: its time is taken from its requests' own
lifespans (first start to last finish), so the set-up is left out, as kvrelay's engine start
is. A transformers without `generate_batch`, or one whose `generate_batch` fails, makes that
peer n/a, never a FAIL of the check.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import time
from dataclasses import dataclass
from typing import Any

from gpu_parts.engine_models import engine_generate, hf_generate, prompts_of
from gpu_parts.report import MISS, PASS, SKIP, Context, Deadline, Row, last_line

PART = "3 engine"
TARGET_TOK_S = 60_000.0  # kvrelay's output tokens/s
VS_GENERATE_BATCH = 15.0  # x transformers' continuous batching
VS_STATIC = 5.0  # x transformers' static batching
GENERATE_BATCH_MIN_LEFT_S = 45.0  # on a GPU: what its set-up and run may take at most


@dataclass(frozen=True)
class Rate:
    tokens: int
    seconds: float
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def continuous_batching_kwargs(model: Any, small: bool, count: int, max_len: int) -> dict[str, Any]:
    """`generate_batch`'s keyword arguments beyond the generation config, as far as this
    transformers takes them: no progress bar; a continuous-batching config that, on the CPU,
    sizes the paged cache for the run (sizing it from free memory takes ~45 s there) and, on
    a GPU, leaves the sizing to transformers but at most half the free memory (kvrelay's
    engine is still alive)."""
    params = inspect.signature(model.generate_batch).parameters
    kwargs: dict[str, Any] = {}
    if "progress_bar" in params:
        kwargs["progress_bar"] = False
    config_class = continuous_batching_config_class()
    if "continuous_batching_config" not in params or config_class is None:
        return kwargs
    page = 32
    wanted: dict[str, Any] = (
        dict(page_size=page, num_blocks=count * (-(-max_len // page) + 1), max_batch_tokens=256)
        if small
        else dict(max_memory_percent=0.5)
    )
    known = {f.name for f in dataclasses.fields(config_class)}
    options = {k: v for k, v in wanted.items() if k in known}
    kwargs["continuous_batching_config"] = config_class(**options)
    return kwargs


def continuous_batching_config_class() -> Any:
    """transformers' ContinuousBatchingConfig dataclass, where this version has one."""
    for module in ("transformers", "transformers.generation.configuration_utils"):
        try:
            found = getattr(importlib.import_module(module), "ContinuousBatchingConfig", None)
        except ImportError:
            continue
        if found is not None and dataclasses.is_dataclass(found):
            return found
    return None


def generate_batch_rate(
    model: Any, prompts: list[list[int]], out_len: int, small: bool
) -> Rate | str:
    """transformers' `generate_batch` on `prompts` (greedy, `out_len` new tokens, no EOS):
    its output tokens over its requests' span, or why it is n/a."""
    if not callable(getattr(model, "generate_batch", None)):
        return "n/a: this transformers has no generate_batch"
    try:
        from transformers import GenerationConfig

        # eos -1: no EOS stop (continuous batching's "none"); min_new_tokens is a logits
        # processor continuous batching may drop. The tokens are counted, not assumed.
        options: dict[str, Any] = dict(max_new_tokens=out_len, do_sample=False, pad_token_id=0)
        try:
            config = GenerationConfig(**options, eos_token_id=-1)
        except ValueError:  # a version that refuses it: EOS stops count fewer tokens
            config = GenerationConfig(**options)
        max_len = max(map(len, prompts)) + out_len
        kwargs = continuous_batching_kwargs(model, small, len(prompts), max_len)
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
        wall = time.perf_counter() - start
    except Exception as exc:  # its failure is this peer's n/a
        return f"n/a: generate_batch raised {last_line(exc)}"
    return rate_of_results(list(dict(results).values()), len(prompts), wall)


def rate_of_results(outputs: list[Any], expected: int, wall: float) -> Rate | str:
    """A `generate_batch` result's rate: every request must be back without an error."""
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    if len(outputs) < expected or errors:
        why = errors[0] if errors else f"{expected - len(outputs)} requests missing"
        return f"n/a: generate_batch returned {len(outputs)}/{expected} ({why})"
    tokens = sum(len(o.generated_tokens) for o in outputs)
    spans = [tuple(getattr(o, "lifespan", (-1, -1))) for o in outputs]
    if spans and all(s[0] > 0 and s[1] >= s[0] for s in spans):
        seconds = max(s[1] for s in spans) - min(s[0] for s in spans)
        return Rate(tokens, seconds, f"{wall:.1f} s with its set-up")
    return Rate(tokens, wall, "timed with its set-up (no lifespans)")


def rate_rows(
    cuda: bool, setup: str, ours: Rate, static: Rate, continuous: Rate | str
) -> list[Row]:
    """The three throughput rows; targets judged on a GPU only."""

    def judged(check: str, ok: bool, value: str, target: str, note: str = "") -> Row:
        if not cuda:
            cpu_note = f"target applies on a GPU; {note}" if note else "target applies on a GPU"
            return Row(PART, check, PASS, value, target, cpu_note)
        return Row(PART, check, PASS if ok else MISS, value, target, note)

    cb = continuous.tok_s if isinstance(continuous, Rate) else None
    peers = f"static batch {static.tok_s:,.0f}, generate_batch " + (
        f"{cb:,.0f} tok/s" if cb is not None else "n/a"
    )
    rows = [
        judged(
            f"135M throughput, {setup}",
            ours.tok_s >= TARGET_TOK_S,
            f"{ours.tok_s:,.0f} output tok/s",
            f">= {TARGET_TOK_S:,.0f} tok/s",
            peers,
        )
    ]
    check = "135M throughput vs transformers generate_batch"
    if isinstance(continuous, str):
        rows.append(Row(PART, check, SKIP, target=f">= {VS_GENERATE_BATCH:.0f}x", note=continuous))
    else:
        ratio = ours.tok_s / continuous.tok_s if continuous.tok_s else float("inf")
        value = f"{ratio:.1f}x ({ours.tok_s:,.0f} vs {continuous.tok_s:,.0f} tok/s)"
        ok = ratio >= VS_GENERATE_BATCH
        rows.append(judged(check, ok, value, f">= {VS_GENERATE_BATCH:.0f}x", continuous.note))
    ratio = ours.tok_s / static.tok_s if static.tok_s else float("inf")
    value = f"{ratio:.1f}x ({ours.tok_s:,.0f} vs {static.tok_s:,.0f} tok/s)"
    check = "135M throughput vs transformers static batch"
    rows.append(judged(check, ratio >= VS_STATIC, value, f">= {VS_STATIC:.0f}x"))
    return rows


def throughput_rows(
    ctx: Context, deadline: Deadline, engine: Any, hf: Any, vocab: int
) -> list[Row]:
    count, prompt_len, out_len = (8, 16, 8) if ctx.small else (256, 128, 128)
    prompts = prompts_of([prompt_len] * count, vocab, seed=11)
    engine_generate(engine, prompts[:4], 4)  # warm-up (first launches)
    start = time.perf_counter()
    engine_generate(engine, prompts, out_len)
    ours = Rate(count * out_len, time.perf_counter() - start)
    hf_generate(hf, prompts[:2], 2)
    start = time.perf_counter()
    hf_generate(hf, prompts, out_len)
    static = Rate(count * out_len, time.perf_counter() - start)
    continuous: Rate | str
    if ctx.cuda and deadline.left() < GENERATE_BATCH_MIN_LEFT_S:
        continuous = f"n/a: time budget ({deadline.left():.0f} s left)"
    else:
        continuous = generate_batch_rate(hf, prompts, out_len, ctx.small)
    if isinstance(continuous, str):
        ctx.log(f"transformers generate_batch: {continuous}")
    setup = f"{count} concurrent ({prompt_len} in / {out_len} out)"
    return rate_rows(ctx.cuda, setup, ours, static, continuous)
