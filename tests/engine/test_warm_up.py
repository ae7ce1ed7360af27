"""The warm-up an engine on an accelerator runs before it is ready (engine/warm_up.py): each
step kind a scheduler produces, on the cache's first blocks, leaving nothing behind. Run here
on the CPU with the torch backend (the fake-CUDA scenarios check the kernels it reaches)."""

from __future__ import annotations

import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.warm_up import (
    DECODES,
    MIXED,
    PREFILL_ONLY,
    WARM_UP_STEPS,
    blocks_needed,
    step_inputs,
    warm_up,
)
from tests.engine.conftest import EngineFactory

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_the_steps_cover_each_kind_a_scheduler_makes() -> None:
    """A prefill alone, a decode beside a chunk that continues a context, decodes alone."""
    kinds = []
    for step in WARM_UP_STEPS:
        _, _, attn = step_inputs(step, block_size=16, num_blocks=64)
        plan = attn.plan
        kinds.append((plan.has_decodes, bool(plan.prefills)))
    assert kinds == [(False, True), (True, True), (True, False)]
    _, _, mixed = step_inputs(MIXED, block_size=16, num_blocks=64)
    chunk = mixed.plan.prefills[0]
    assert chunk.context_len > chunk.q_end - chunk.q_start  # the chunk reads earlier keys
    assert (PREFILL_ONLY, MIXED, DECODES) == WARM_UP_STEPS


def test_positions_and_slots_follow_each_sequence_s_own_blocks() -> None:
    ids, positions, attn = step_inputs(((18, 1), (21, 4)), block_size=16, num_blocks=8)
    assert positions.tolist() == [17, 17, 18, 19, 20]
    # The first sequence owns blocks 0-1, the second 2-3.
    assert attn.slot_mapping.tolist() == [17, 32 + 17, 32 + 18, 32 + 19, 32 + 20]
    assert attn.block_tables.tolist() == [[0, 1], [2, 3]]
    assert ids.shape == positions.shape
    assert blocks_needed(16) == 4
    assert blocks_needed(4) == 11  # 5 + 6 blocks of 4 for the mixed step


def test_warm_up_runs_every_step_and_changes_no_later_output(
    make_engine: EngineFactory,
) -> None:
    """A warmed-up engine generates what a fresh one does: the warm-up's K/V went into free
    blocks that requests overwrite before they read them, and it left no state behind."""
    prompt = [5, 9, 3, 7, 11, 4]
    fresh = make_engine()
    fresh.add_request("r", prompt, GREEDY)
    expected = _run(fresh)

    warmed = make_engine()
    kv = warmed.runner.kv_cache
    before = kv.clone()
    rng_before = warmed.runner.sampler._generator.get_state()
    assert warm_up(warmed.runner.model, kv, warmed.runner.sampler) == len(WARM_UP_STEPS)
    # Its draws come from fixed uniforms: the engine's own random stream is where it was.
    assert torch.equal(warmed.runner.sampler._generator.get_state(), rng_before)
    assert not torch.equal(kv, before)  # it really wrote K/V
    assert warmed.kv_cache.pool.is_whole() and not warmed.has_unfinished_requests()
    warmed.add_request("r", prompt, GREEDY)
    assert _run(warmed) == expected


def test_a_cache_too_small_for_the_steps_is_left_alone(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=32)
    assert warm_up(engine.runner.model, engine.runner.kv_cache) == 0


def _run(engine: Engine) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens
