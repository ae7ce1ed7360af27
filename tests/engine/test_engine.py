"""Engine on a tiny random Llama: continuous batching, chunked prefill, preemption, aborts, n."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from tests.engine.conftest import (
    TINY_VOCAB,
    EngineFactory,
    assert_pool_whole,
    hf_greedy,
    run_to_completion,
)


def greedy(tokens: int) -> SamplingParams:
    # min_tokens masks EOS exactly as HF's min_new_tokens does, so both run `tokens` steps.
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def test_batched_chunked_preempted_greedy_equals_transformers(
    make_engine: EngineFactory, tiny_llama_dir: Path
) -> None:
    # 12 blocks of 4 tokens cannot hold 6 sequences of up to 40 + 12 tokens: preemption must
    # happen; 8-token steps chunk every prompt.
    engine = make_engine(num_blocks=14, max_num_batched_tokens=8)
    batch = prompts(6)
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, greedy(12))
    done = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(batch):
        assert done[str(i)][0] == hf_greedy(tiny_llama_dir, prompt, 12), f"prompt {i}"
    assert_pool_whole(engine)


def test_requests_join_and_leave_between_steps(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("short", [5, 6, 7], greedy(2))
    engine.add_request("long", [5, 6, 7], greedy(6))
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step == 2:
            engine.add_request("late", [9, 9], greedy(1))
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
    assert finished_at == {"short": 2, "late": 2, "long": 6}
    assert_pool_whole(engine)


def test_abort_frees_blocks_at_any_point(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=4)
    engine.add_request("a", list(range(3, 30)), greedy(20))
    engine.add_request("b", list(range(3, 10)), greedy(20))
    engine.step()  # "a" is mid-prefill
    out = engine.abort("a")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    for _ in range(5):
        engine.step()
    engine.abort("b")  # mid-decode
    assert engine.abort("unknown") is None
    assert_pool_whole(engine)


def test_n_samples_with_seed_equal_separate_seeded_requests(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    engine.add_request("group", [4, 5, 6], params)
    for i in range(3):
        engine.add_request(
            f"solo{i}", [4, 5, 6], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8)
        )
    done = run_to_completion(engine)
    assert done["group"] == [done[f"solo{i}"][0] for i in range(3)]
    assert len({tuple(s) for s in done["group"]}) > 1, "samples should differ"
    assert_pool_whole(engine)


def test_stop_token_and_max_tokens_finish_reasons(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("free", [7, 8], greedy(5))
    first = run_to_completion(engine)["free"][0]
    engine.add_request(
        "stopped", [7, 8], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[first[2]])
    )
    engine.add_request(
        "length", [7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    stopped = outputs["stopped"]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == first[2]
    assert stopped.token_ids == first[: first.index(first[2]) + 1]
    assert outputs["length"].finish_reason == "length"
    assert len(outputs["length"].token_ids) == 3
    assert_pool_whole(engine)


def test_context_length_caps_generation(make_engine: EngineFactory) -> None:
    engine = make_engine(max_model_len=10)
    engine.add_request("a", list(range(3, 10)), SamplingParams(max_tokens=100, ignore_eos=True))
    done = run_to_completion(engine)
    assert len(done["a"][0]) == 3  # 7 prompt + 3 output = max_model_len
    assert_pool_whole(engine)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "empty"),
        ([TINY_VOCAB], "outside the vocabulary"),
        ([5] * 256, "max_model_len"),
    ],
)
def test_bad_prompts_are_rejected_and_leave_nothing(
    make_engine: EngineFactory, prompt: list[int], match: str
) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams())
    assert_pool_whole(engine)


def test_prompt_larger_than_kv_cache_is_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache holds only 8"):
        engine.add_request("big", list(range(3, 13)), SamplingParams())
    engine.add_request("dup", [3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [3], SamplingParams())
    run_to_completion(engine)
    assert_pool_whole(engine)


def test_failed_step_frees_the_batch(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    engine.add_request("a", [3, 4, 5], SamplingParams())

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("forward failed")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    assert_pool_whole(engine)


def test_n_samples_follow_the_one_fan_out_rule(make_engine: EngineFactory) -> None:
    """Sample ids are `sample_request_id`'s and seeds `for_sample`'s: the top seed wraps to 0
    (seed + index mod 2**64), so sample 1 is what a request seeded 0 gives."""
    engine = make_engine()
    params = SamplingParams(n=2, temperature=1.0, seed=2**64 - 1, max_tokens=8)
    engine.add_request("group", [4, 5, 6], params)
    assert [r.request_id for r in engine.scheduler.waiting] == ["group#0"]  # #1 forks from it
    engine.add_request(
        "top", [4, 5, 6], SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=8)
    )
    engine.add_request("zero", [4, 5, 6], SamplingParams(temperature=1.0, seed=0, max_tokens=8))
    done = run_to_completion(engine)
    assert done["group"] == [done["top"][0], done["zero"][0]]
    assert_pool_whole(engine)


def greedy_beside(
    make_engine: EngineFactory, batch: list[list[int]]
) -> tuple[dict[str, list[list[int]]], Engine]:
    """`batch`'s greedy tokens run alone (request ids r0, r1, ...), and an engine holding the
    same requests, for a test to add its own beside them."""
    alone = make_engine()
    for i, prompt in enumerate(batch):
        alone.add_request(f"r{i}", prompt, greedy(6))
    expected = run_to_completion(alone)
    engine = make_engine()
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, greedy(6))
    return expected, engine


def test_allowed_token_ids_hold_their_request_alone(make_engine: EngineFactory) -> None:
    """Greedy and hot samples keep to their allowed ids; the batch's other requests give
    exactly the tokens they give alone. An allowed id outside the vocabulary is refused."""
    batch = prompts(3, seed=5)
    expected, engine = greedy_beside(make_engine, batch)
    allowed = [7, 19, 23]
    engine.add_request(
        "kept", batch[0], SamplingParams.greedy(max_tokens=6, allowed_token_ids=allowed)
    )
    hot = SamplingParams(temperature=3.0, seed=1, max_tokens=12, allowed_token_ids=allowed)
    engine.add_request("hot", batch[1], hot)
    with pytest.raises(ValueError, match=rf"allowed_token_ids: .* must be in \[0, {TINY_VOCAB}\)"):
        engine.add_request("bad", [3], SamplingParams(allowed_token_ids=[1, TINY_VOCAB]))
    done = run_to_completion(engine)
    assert set(done["kept"][0]) <= set(allowed) and len(done["kept"][0]) == 6
    assert set(done["hot"][0]) <= set(allowed) and len(set(done["hot"][0])) > 1
    assert {rid: done[rid] for rid in expected} == expected
    assert_pool_whole(engine)


def test_logit_bias_steers_its_request_alone(make_engine: EngineFactory) -> None:
    """A +100 bias makes greedy pick that token every step; the batch's other requests give
    exactly the tokens they give alone. A bias id outside the vocabulary is refused."""
    batch = prompts(3, seed=4)
    expected, engine = greedy_beside(make_engine, batch)
    forced = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={17: 100.0})
    engine.add_request("forced", batch[0], forced)
    banned = {t: -100.0 for t in expected["r0"][0]}  # every token r0 chose, banned
    engine.add_request("banned", batch[0], SamplingParams.greedy(max_tokens=6, logit_bias=banned))
    with pytest.raises(ValueError, match=rf"logit_bias: .* must be in \[0, {TINY_VOCAB}\)"):
        engine.add_request("bad", [3], SamplingParams(logit_bias={TINY_VOCAB: 1.0}))
    done = run_to_completion(engine)
    assert done["forced"] == [[17] * 6]
    assert set(done["banned"][0]).isdisjoint(banned)
    assert {rid: done[rid] for rid in expected} == expected
    assert_pool_whole(engine)
