"""Part 3's exactness check: in fp32 with TF32 off on both sides, kvrelay's greedy tokens must
EQUAL transformers' `generate` on the same weights, token for token, with CUDA graphs and with
--enforce-eager.

Why fp32 and not a near-tie allowance in bf16: two correct bf16 implementations round
differently, and a check that forgives partings "at a near-tie" forgave nearly everything with
transformers' default init, where most top logits tie. In fp32, on weights drawn so that the
top two logits sit well apart (engine_models' INIT_GAIN), any parting is a bug; the note gives
transformers' logit gap at the parting, to tell a rounding tie from a real difference.

EOS: our requests run without `ignore_eos` and transformers' without `min_new_tokens` (which
masks EOS, where `ignore_eos` does not), so either side may stop early at an EOS; sequences are
compared up to and including their first EOS.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gpu_parts.engine_models import (
    build_model,
    engine_generate,
    eos_ids,
    free_device_memory,
    hf_generate,
    logit_gap,
    make_engine,
    model_key,
    prompts_of,
)
from gpu_parts.report import FAIL, PASS, SKIP, Context, Deadline, Row

PART = "3 engine"
LENGTHS = {False: [3, 17, 40, 64, 130, 257, 511, 777], True: [3, 9, 17, 33, 64, 100, 150, 200]}
MAX_TOKENS = {False: 40, True: 16}  # by ctx.small


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 (no TF32) inside; the flags restored after.
    Engine creation goes inside too: a CUDA graph keeps the kernels chosen at capture."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def upto_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """`tokens` up to and including the first EOS (all of them when there is none)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def first_parting(ours: list[int], theirs: list[int], eos: set[int]) -> int | None:
    """Where two greedy outputs first differ once each is cut at its first EOS, or None when
    they are equal. A sequence that ends (at an EOS, or shorter) where the other goes on parts
    at that position."""
    a, b = upto_eos(ours, eos), upto_eos(theirs, eos)
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def exact_row(
    check: str,
    hf: Any,
    prompts: list[list[int]],
    ours: list[list[int]],
    theirs: list[list[int]],
    eos: set[int],
) -> Row:
    """PASS when every prompt's output equals the reference's (module docstring on EOS)."""
    equal, first = 0, ""
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        at = first_parting(a, b, eos)
        if at is None:
            equal += 1
            continue
        if not first:
            mine = a[at] if at < len(a) else "end"
            ref = b[at] if at < len(b) else "end"
            first = f"prompt of {len(prompt)}: token {at} is {mine}, transformers {ref}"
            if isinstance(mine, int) and isinstance(ref, int):
                gap = logit_gap(hf, prompt + b[:at], ref, mine)
                first += f" (its logit gap {gap:.2e})"
    value = f"{equal}/{len(prompts)} equal"
    ended = sum(any(t in eos for t in b) for b in theirs)
    note = first or (f"{ended} ended at an EOS" if ended else "")
    return Row(PART, check, PASS if equal == len(prompts) else FAIL, value, "all equal", note)


def exact_rows(ctx: Context, deadline: Deadline, name: str, label: str) -> list[Row]:
    """The fp32 model of shape `name`: transformers' greedy tokens, then kvrelay's with CUDA
    graphs and with --enforce-eager, each compared exactly."""
    modes = (("graphs", False), ("--enforce-eager", True))
    checks = [f"{label} fp32: greedy tokens == transformers, {mode}" for mode, _ in modes]
    if deadline.expired():
        return [Row(PART, check, SKIP, note="time budget") for check in checks]
    rows = []
    small = ctx.small
    with no_tf32():
        folder, hf = build_model(ctx, name, dtype=torch.float32)
        prompts = prompts_of(LENGTHS[small], hf.config.vocab_size, seed=5)
        theirs = hf_generate(hf, prompts, MAX_TOKENS[small], min_new_tokens=False)
        eos = eos_ids(hf)
        for check, (_, eager) in zip(checks, modes, strict=True):
            if deadline.expired():
                rows.append(Row(PART, check, SKIP, note="time budget"))
                continue
            try:
                engine = make_engine(ctx, folder, eager=eager, max_num_seqs=8,
                                     kv_cache_memory="64MiB" if small else "1GiB",
                                     dtype=torch.float32)  # fmt: skip
            except NotImplementedError as exc:
                rows.append(Row(PART, check, SKIP, note=f"n/a: {exc}"))
                continue
            ours = engine_generate(engine, prompts, MAX_TOKENS[small], ignore_eos=False)
            del engine
            free_device_memory()
            rows.append(exact_row(check, hf, prompts, ours, theirs, eos))
    if model_key(ctx, name, torch.float32, None) != f"model:{name}":  # not the run's own model
        ctx.shared.pop(model_key(ctx, name, torch.float32, None), None)
    del hf
    free_device_memory()
    return rows
