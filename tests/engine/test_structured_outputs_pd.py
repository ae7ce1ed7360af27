"""Structured outputs across engines: a prefill engine samples the first token under the
grammar, the decode engine's fresh matcher is fed that token (the pull and the compile
overlapping, in either order), and a resumed sequence's matcher is fed its tokens so far; the
output is the colocated one token for token, and nothing leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from tests.engine.conftest import EngineFactory, assert_pool_whole
from tests.engine.grammar_vocab import decode, with_tokenizer
from tests.engine.test_disaggregation import copy_blocks, decode_all, prefill
from tests.engine.test_structured_outputs import JSON, check_schema, constrained, run_outputs

PROMPT = [5, 17, 33, 4, 90, 61, 7, 12, 44]
PARAMS = {
    "greedy": constrained(JSON),
    "seeded": constrained(JSON, temperature=1.0, seed=3, logprobs=2),
}


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny-grammar-pd"))


def colocated(make_engine: EngineFactory, params: SamplingParams) -> list[int]:
    engine = make_engine()
    engine.add_request("whole", PROMPT, params)
    tokens = run_outputs(engine)["whole"].outputs[0].token_ids
    assert_pool_whole(engine)
    return tokens


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("pull", ["before", "after", "failed"])
def test_prefill_then_decode_under_a_grammar_equals_colocated(
    make_engine: EngineFactory, tiny_llama_dir: Path, name: str, pull: str
) -> None:
    """`pull`: the pull ends before the decode engine's grammar compiles (applied once it
    is), after it, or fails (its prompt is recomputed, the matcher kept)."""
    params = PARAMS[name]
    expected = colocated(make_engine, params)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, params)["r"]
    assert handle.first_token_id == expected[0]  # sampled under the grammar there
    lock = dec._grammar.compiler._tokenizer_lock
    if pull != "after":
        lock.acquire()  # the decode engine's compile waits until the pull has ended
    plan = dec.add_prefilled_request("r", PROMPT, params, handle)
    assert plan is not None and dec.has_work()
    copy_blocks(pre, dec, plan)
    if pull == "after":
        dec._grammar.compiler.compile(JSON).result(timeout=30)
        dec.step()  # the grammar is ready: matcher on, still waiting for its KV
        assert dec.stats().num_pulling == 1
    dec.finish_pull("r", ok=pull != "failed")
    if pull != "after":
        assert dec.stats().num_pulling == 1  # deferred: nothing runs without its matcher
        assert dec.step() == [] and dec.has_work()
        lock.release()
    pre.release_kv("r")
    output = decode_all(dec)["r"].outputs[0]
    assert output.token_ids == expected and output.finish_reason == "stop"
    check_schema(json.loads(decode(tiny_llama_dir, output.token_ids)))
    assert dec.stats().kv_pull_fallbacks == (pull == "failed")
    for engine in (pre, dec):
        assert_pool_whole(engine)


def test_a_handed_off_token_the_grammar_refuses_fails_the_request(
    make_engine: EngineFactory,
) -> None:
    """The decode engine checks the first token against its own matcher: a prefill engine
    that sampled without the grammar is caught, the pull forgotten, every block freed."""
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    free = SamplingParams(temperature=0.0, max_tokens=8)
    handle = prefill(pre, {"r": PROMPT}, free)["r"]
    only_z = StructuredOutputs(StructuredKind.REGEX, "z+")
    assert handle.first_token_id != 3 + ord("z") - 32
    plan = dec.add_prefilled_request("r", PROMPT, constrained(only_z), handle)
    assert plan is not None
    output = decode_all(dec)["r"]
    assert output.error is not None and output.error.startswith("structured_outputs")
    assert str(handle.first_token_id) in output.error
    dec.finish_pull("r", ok=True)  # a late pull completion is ignored
    pre.release_kv("r")
    for engine in (pre, dec):
        assert_pool_whole(engine)


def test_abort_while_pulling_and_compiling(make_engine: EngineFactory) -> None:
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    handle = prefill(pre, {"r": PROMPT}, PARAMS["greedy"])["r"]
    with dec._grammar.compiler._tokenizer_lock:
        plan = dec.add_prefilled_request("r", PROMPT, PARAMS["greedy"], handle)
        assert plan is not None
        dec.finish_pull("r", ok=True)
        aborted = dec.abort("r")
        assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert not dec.has_work()
    pre.release_kv("r")
    for engine in (pre, dec):
        assert_pool_whole(engine)


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("done", [1, 5, 12])
def test_a_resumed_sequence_continues_its_grammar(
    make_engine: EngineFactory, name: str, done: int
) -> None:
    params = PARAMS[name]
    expected = colocated(make_engine, params)
    assert len(expected) > done
    engine = make_engine()
    engine.add_request("moved", PROMPT, params, resume_output_token_ids=expected[:done])
    output = run_outputs(engine)["moved"].outputs[0]
    assert output.token_ids == expected and output.finish_reason == "stop"
    assert_pool_whole(engine)


def test_resumed_tokens_the_grammar_refuses_fail_the_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    not_json = [3 + ord("x") - 32]
    engine.add_request("moved", PROMPT, PARAMS["greedy"], resume_output_token_ids=not_json)
    engine.add_request("other", PROMPT, PARAMS["greedy"])
    done = run_outputs(engine)
    assert done["moved"].error is not None and "breaks the grammar" in done["moved"].error
    assert done["other"].error is None and done["other"].outputs[0].finish_reason == "stop"
    assert_pool_whole(engine)


def test_a_resumed_sequence_that_completed_its_grammar_stops_at_once(
    make_engine: EngineFactory,
) -> None:
    choice = constrained(StructuredOutputs.choice(["yes!", "no"]))
    expected = colocated(make_engine, choice)
    engine = make_engine()
    engine.add_request("moved", PROMPT, choice, resume_output_token_ids=expected)
    output = run_outputs(engine)["moved"].outputs[0]
    assert output.token_ids == expected and output.finish_reason == "stop"
    assert engine.stats().generation_tokens == 0  # not one step ran for it
    assert_pool_whole(engine)


def test_the_prefill_engine_takes_constrained_requests(make_engine: EngineFactory) -> None:
    pre = make_engine(role="prefill")
    with pytest.raises(ValueError, match="n = 1"):
        pre.add_request("a", PROMPT, constrained(JSON, n=2))
    pre.add_request("b", PROMPT, constrained(StructuredOutputs.choice(["x"])))
    # The first token completes this grammar: it ends on the prefill engine, nothing leased.
    out = decode_all(pre)["b"]
    assert out.kv_handle is None and out.outputs[0].finish_reason == "stop"
    assert pre.stats().num_leases == 0
    assert_pool_whole(pre)
