"""Engine with the prefix cache on the tiny Llama: same tokens as without it, counters, n > 1
forks with copy-on-write, preemption, reset, and a whole pool on every path."""

from __future__ import annotations

import random

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.scheduled import SchedulerOutput
from tests.engine.conftest import TINY_VOCAB, EngineFactory, assert_pool_whole, run_to_completion


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def spy_plans(engine: Engine) -> list[SchedulerOutput]:
    """Record every step's plan."""
    plans: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        plans.append(out)
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts over one 13-token base (block size 4): the second shares 6 tokens (inside a
    block), the third 8 (a block boundary), the fourth is the whole base again, the fifth the
    base plus a continuation."""
    rng = random.Random(seed)
    base = [rng.randrange(3, TINY_VOCAB) for _ in range(13)]
    tail = [rng.randrange(3, TINY_VOCAB) for _ in range(9)]
    return [base, base[:6] + tail, base[:8] + tail, list(base), base + tail]


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_greedy_tokens_equal_with_cache_on_and_off(
    make_engine: EngineFactory, one_at_a_time: bool
) -> None:
    batch = shared_prefix_prompts()
    results = {}
    for caching in (True, False):
        engine = make_engine(enable_prefix_caching=caching)
        done: dict[str, list[list[int]]] = {}
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, greedy(6))
            if one_at_a_time:
                done |= run_to_completion(engine)
        done |= run_to_completion(engine)
        results[caching] = done
        stats = engine.stats()
        if caching and one_at_a_time:
            # Hits: 4 (6 shared tokens: one full block), 8 (a block boundary), 12 (the whole
            # 13-token base: at most 12, one token is recomputed), 12 (the base's blocks).
            assert stats.prefix_cache_hits == 4 + 8 + 12 + 12
            assert stats.prefix_cache_queries == sum(len(p) for p in batch)
        elif not caching:
            assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
            assert stats.num_cached_blocks == 0
        assert_pool_whole(engine)
    assert results[True] == results[False]


def test_blocks_filled_by_decode_are_reused_by_the_next_turn(make_engine: EngineFactory) -> None:
    engine = make_engine()
    first_turn = list(range(3, 16))  # 13 tokens
    engine.add_request("turn1", first_turn, greedy(6))
    reply = run_to_completion(engine)["turn1"][0]
    # 13 prompt + 5 computed output tokens: 4 full blocks cached, the 4th filled by decode.
    engine.add_request("turn2", [*first_turn, *reply, 40], greedy(2))
    run_to_completion(engine)
    assert engine.stats().prefix_cache_hits == 16
    assert_pool_whole(engine)


def test_whole_prompt_cached_recomputes_its_last_block(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = list(range(3, 11))  # 8 tokens: two full blocks
    engine.add_request("a", prompt, greedy(3))
    first = run_to_completion(engine)
    plans = spy_plans(engine)
    engine.add_request("b", prompt, greedy(3))
    second = run_to_completion(engine)
    assert first["a"] == second["b"]
    assert (plans[0].chunks[0].start, plans[0].chunks[0].num_tokens) == (4, 4)
    assert_pool_whole(engine)


def test_n_samples_prefill_once_and_copy_the_shared_partial_block(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    plans = spy_plans(engine)
    prompt = [4, 5, 6, 7, 8, 9]  # one full block and a partial one, shared by the samples
    engine.add_request("group", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    done = run_to_completion(engine)
    first = plans[0]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in first.chunks] == [
        ("group#0", 0, 6)
    ]
    assert [f.request_id for f in first.chunks[0].forks] == ["group#1", "group#2"]
    # The first decode: two samples copy block 1, the last one writes into it in place.
    decode = plans[1]
    assert len(decode.chunks) == 3
    assert len(decode.copies) == 2
    assert {src for src, _ in decode.copies} == {1}
    assert sum(len(p.copies) for p in plans) == 2
    for i in range(3):
        engine.add_request(
            f"solo{i}", prompt, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6)
        )
    solos = run_to_completion(engine)
    assert done["group"] == [solos[f"solo{i}"][0] for i in range(3)]
    assert_pool_whole(engine)


def test_n_samples_on_a_block_boundary_need_no_copy(make_engine: EngineFactory) -> None:
    engine = make_engine()
    plans = spy_plans(engine)
    engine.add_request("g", list(range(3, 11)), SamplingParams(n=2, seed=1, max_tokens=5))
    run_to_completion(engine)
    assert not any(p.copies for p in plans)
    assert_pool_whole(engine)


def test_n_samples_abort_before_and_after_the_fork(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=4)
    engine.add_request("early", list(range(3, 20)), SamplingParams(n=3, max_tokens=20))
    engine.add_request("late", list(range(3, 9)), SamplingParams(n=3, max_tokens=20))
    engine.step()  # "early" is mid-prefill, its samples not forked yet
    out = engine.abort("early")
    assert out is not None and [o.finish_reason for o in out.outputs] == ["abort"] * 3
    for _ in range(6):
        engine.step()
    assert len(engine.scheduler.running) == 3  # "late" forked
    engine.abort("late")
    assert engine.scheduler.num_unfinished == 0
    assert_pool_whole(engine)


def test_n_samples_with_preemption_equal_separate_requests(make_engine: EngineFactory) -> None:
    prompt = list(range(5, 15))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12)
    engine = make_engine(num_blocks=9, max_num_batched_tokens=8)
    engine.add_request("group", prompt, params)
    done = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    assert_pool_whole(engine)
    solo = make_engine(enable_prefix_caching=False)
    for i in range(4):
        solo.add_request(str(i), prompt, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=12))
    solos = run_to_completion(solo)
    assert done["group"] == [solos[str(i)][0] for i in range(4)]


def test_preempted_request_resumes_from_the_cache(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=12, max_num_batched_tokens=64)
    for i in range(2):
        engine.add_request(str(i), [3 + i] * 12, greedy(16))
    with_cache = run_to_completion(engine)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0  # recomputation found its own blocks again
    assert_pool_whole(engine)
    reference = make_engine(enable_prefix_caching=False, num_blocks=64)
    for i in range(2):
        reference.add_request(str(i), [3 + i] * 12, greedy(16))
    assert with_cache == run_to_completion(reference)


def test_reset_prefix_cache_and_metrics(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("a", list(range(3, 12)), greedy(2))
    engine.step()
    assert not engine.reset_prefix_cache()  # blocks in use
    final = engine.step()[-1]
    assert final.finished
    assert final.metrics["first_token_time"] >= final.metrics["arrival_time"]
    assert engine.stats().num_cached_blocks == 2
    assert engine.reset_prefix_cache()
    assert engine.stats().num_cached_blocks == 0
    engine.add_request("b", list(range(3, 12)), greedy(2))
    first = engine.step()
    assert first[0].metrics["num_cached_tokens"] == 0
    run_to_completion(engine)
    assert_pool_whole(engine)
