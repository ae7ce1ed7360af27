"""Continuing a sequence another engine started (issue 13's mid-stream migration, engine side):
`add_request(..., resume_output_token_ids=...)` on a fresh engine gives exactly the tokens an
undisturbed run gives — greedy, seeded, with penalties — and a seeded request prefilled on one
engine and decoded on another draws the same stream as a colocated one."""

from __future__ import annotations

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion
from tests.engine.test_disaggregation import copy_blocks, decode_all, prefill

PROMPT = [5, 17, 33, 4, 90, 61, 7, 12, 44]
TOKENS = 14


def undisturbed(engine: Engine, params: SamplingParams) -> list[int]:
    engine.add_request("whole", PROMPT, params)
    return run_to_completion(engine)["whole"][0]


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=TOKENS, min_tokens=TOKENS),
    "seeded top-k, penalties": SamplingParams(
        temperature=0.8,
        top_k=20,
        seed=2**64 - 1,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        max_tokens=TOKENS,
        min_tokens=TOKENS,
    ),
}


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("done", [1, 6, TOKENS - 1])
def test_a_resumed_sequence_goes_on_as_if_undisturbed(
    make_engine: EngineFactory, name: str, done: int
) -> None:
    params = PARAMS[name]
    expected = undisturbed(make_engine(), params)
    engine = make_engine()
    engine.add_request("moved", PROMPT, params, resume_output_token_ids=expected[:done])
    outputs = run_to_completion(engine)
    assert outputs["moved"][0] == expected
    assert_pool_whole(engine)


def test_resume_checks_what_it_is_given(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="n = 1"):
        engine.add_request("a", PROMPT, SamplingParams(n=2), resume_output_token_ids=[3])
    with pytest.raises(ValueError, match="nothing to generate"):
        engine.add_request("b", PROMPT, params, resume_output_token_ids=[3, 4, 5, 6])
    with pytest.raises(ValueError, match="must be in"):
        engine.add_request("c", PROMPT, params, resume_output_token_ids=[10**6])
    assert not engine.has_unfinished_requests()  # nothing half-registered
    engine.add_request("a", PROMPT, params, resume_output_token_ids=[3])  # the ids are free
    run_to_completion(engine)
    assert_pool_whole(engine)


def test_a_seeded_request_draws_the_same_stream_disaggregated(
    make_engine: EngineFactory,
) -> None:
    params = PARAMS["seeded"]
    expected = undisturbed(make_engine(), params)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, params)["r"]
    plan = dec.add_prefilled_request("r", PROMPT, params, handle)
    assert plan is not None
    copy_blocks(pre, dec, plan)
    dec.finish_pull("r", ok=True)
    pre.release_kv("r")
    assert decode_all(dec)["r"].outputs[0].token_ids == expected


def test_a_resumed_sequence_with_logprobs_gives_them_for_its_new_tokens(
    make_engine: EngineFactory,
) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=TOKENS, logprobs=2)
    whole = make_engine()
    whole.add_request("whole", PROMPT, params)
    done_whole = {}
    while whole.has_unfinished_requests():
        for out in whole.step():
            if out.finished:
                done_whole[out.request_id] = out.outputs[0]
    expected = done_whole["whole"]
    engine = make_engine()
    engine.add_request("moved", PROMPT, params, resume_output_token_ids=expected.token_ids[:5])
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out.outputs[0]
    assert final is not None and expected.logprobs is not None and final.logprobs is not None
    assert final.token_ids == expected.token_ids
    # The new tokens' logprobs: the same tokens, values up to accumulation order (the resumed
    # tokens were computed in one prefill, not token by token).
    for got, want in zip(final.logprobs[5:], expected.logprobs[5:], strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in want)
    assert_pool_whole(engine)
