"""Structured outputs in the engine, on the tiny random Llama with a real byte-level tokenizer
(grammar_vocab.py): every kind of constraint is met, greedy output is the grammar-masked
argmax token for token, other requests are untouched, the grammar's end stops a sample, and
failures, aborts and preemption leave no block behind."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from kvrelay.engine.engine import Engine
from kvrelay.engine.grammar import GrammarCompiler
from kvrelay.engine.outputs import RequestOutput
from tests.engine.conftest import TINY_VOCAB, EngineFactory, assert_pool_whole, run_to_completion
from tests.engine.grammar_vocab import EOS, allowed_tokens, decode, with_tokenizer

PROMPT = [5, 17, 99, 3, 42]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
JSON = StructuredOutputs.json_schema(SCHEMA)
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "ab"'


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The conftest's tiny model, copied with a tokenizer (this module's engines use it)."""
    return with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny-grammar"))


def constrained(constraint: StructuredOutputs, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 60)
    return SamplingParams(structured_outputs=constraint, **kwargs)


def run_outputs(engine: Engine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    raise AssertionError("engine did not finish")


def check_schema(value: Any) -> None:
    """SCHEMA, checked by hand."""
    assert isinstance(value, dict) and set(value) == {"name", "ok", "n"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 99


def masked_greedy(model_dir: Path, constraint: StructuredOutputs, max_tokens: int) -> list[int]:
    """Reference: transformers' logits, every token the grammar refuses dropped, argmax;
    the grammar's end (or EOS) ends it, as the engine is meant to."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    compiler = GrammarCompiler(str(model_dir), TINY_VOCAB, (EOS,))
    matcher = compiler.compile(constraint).result().deep_copy()
    ids, out = list(PROMPT), []
    while len(out) < max_tokens:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        mask = torch.full_like(logits, float("-inf"))
        mask[sorted(allowed_tokens(matcher, TINY_VOCAB))] = 0.0
        token = int((logits + mask).argmax())
        out.append(token)
        ids.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    return out


@pytest.mark.parametrize(
    "constraint",
    [
        JSON,
        StructuredOutputs(StructuredKind.REGEX, "[a-c]{2,4}-[0-9]+"),
        StructuredOutputs.choice(["yes", "no way"]),
    ],
    ids=["json", "regex", "choice"],
)
def test_greedy_output_is_the_grammar_masked_argmax(
    make_engine: EngineFactory, tiny_llama_dir: Path, constraint: StructuredOutputs
) -> None:
    engine = make_engine()
    engine.add_request("a", PROMPT, constrained(constraint, max_tokens=40))
    [tokens] = run_to_completion(engine)["a"]
    assert tokens == masked_greedy(tiny_llama_dir, constraint, 40)
    assert_pool_whole(engine)


def test_every_kind_of_constraint_is_met(make_engine: EngineFactory, tiny_llama_dir: Path) -> None:
    engine = make_engine()
    regex = "[a-c]{2,4}-[0-9]+"
    cases = {
        "json": JSON,
        "json_object": StructuredOutputs(StructuredKind.JSON_OBJECT),
        "regex": StructuredOutputs(StructuredKind.REGEX, regex),
        "choice": StructuredOutputs.choice(["yes", "no way", "maybe"]),
        "gbnf": StructuredOutputs(StructuredKind.GRAMMAR, GBNF),
    }
    for name, constraint in cases.items():
        # Sampled: the mask must hold whatever the draws; seeded, so a failure reruns.
        params = constrained(constraint, temperature=1.0, seed=7, max_tokens=80)
        engine.add_request(name, PROMPT, params)
    done = run_outputs(engine)
    texts = {name: decode(tiny_llama_dir, done[name].outputs[0].token_ids) for name in cases}
    for name in ("json", "regex", "choice", "gbnf"):
        assert done[name].outputs[0].finish_reason == "stop", (name, texts[name])
    check_schema(json.loads(texts["json"]))
    if done["json_object"].outputs[0].finish_reason == "stop":  # unbounded: may run long
        assert isinstance(json.loads(texts["json_object"]), dict)
    else:
        assert texts["json_object"].startswith("{")
    assert re.fullmatch(regex, texts["regex"]), texts["regex"]
    assert texts["choice"] in ("yes", "no way", "maybe")
    assert re.fullmatch(r"\((?:[0-9]|ab)(?:,(?:[0-9]|ab))*\)", texts["gbnf"]), texts["gbnf"]
    assert_pool_whole(engine)


def test_the_grammars_end_stops_the_sample_without_eos(make_engine: EngineFactory) -> None:
    """The last token completes the grammar: the sample ends there, "stop" as at EOS, with
    no stop reason and no EOS token (nothing else could follow)."""
    engine = make_engine()
    engine.add_request("a", PROMPT, constrained(JSON))
    output = run_outputs(engine)["a"].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason is None
    assert EOS not in output.token_ids and len(output.token_ids) < 60


def test_n_samples_each_follow_the_grammar_and_equal_single_requests(
    make_engine: EngineFactory, tiny_llama_dir: Path
) -> None:
    """n = 2 shares one prefill (forked at the first token): each sample has its own matcher,
    and sample i is what a request with seed + i gives alone."""
    engine = make_engine()
    engine.add_request("pair", PROMPT, constrained(JSON, n=2, temperature=1.0, seed=11))
    for i in range(2):
        engine.add_request(f"alone{i}", PROMPT, constrained(JSON, temperature=1.0, seed=11 + i))
    done = run_outputs(engine)
    samples = [o.token_ids for o in done["pair"].outputs]
    assert samples == [done[f"alone{i}"].outputs[0].token_ids for i in range(2)]
    assert samples[0] != samples[1]
    for tokens in samples:
        check_schema(json.loads(decode(tiny_llama_dir, tokens)))
    assert_pool_whole(engine)


def test_unconstrained_neighbours_get_the_same_tokens(make_engine: EngineFactory) -> None:
    neighbours = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=12),
        "logprobs": SamplingParams(temperature=0.0, max_tokens=6, logprobs=3),
    }
    alone = make_engine()
    for rid, params in neighbours.items():
        alone.add_request(rid, [*PROMPT, len(rid)], params)
    expected = run_outputs(alone)
    mixed = make_engine()
    mixed.add_request("json", PROMPT, constrained(JSON, temperature=0.7, seed=1))
    for rid, params in neighbours.items():
        mixed.add_request(rid, [*PROMPT, len(rid)], params)
    mixed.add_request("choice", PROMPT, constrained(StructuredOutputs.choice(["yes", "no"])))
    got = run_outputs(mixed)
    for rid in neighbours:
        assert got[rid].outputs[0].token_ids == expected[rid].outputs[0].token_ids, rid
        # Logprobs up to the batch's accumulation order (another batch shape, other sums).
        got_lp, want_lp = got[rid].outputs[0].logprobs, expected[rid].outputs[0].logprobs
        assert (got_lp is None) == (want_lp is None), rid
        for step_got, step_want in zip(got_lp or [], want_lp or [], strict=True):
            assert step_got == pytest.approx(step_want, abs=1e-4), rid
    assert got["json"].outputs[0].finish_reason == "stop"
    assert_pool_whole(mixed)


def test_logprobs_see_only_what_the_grammar_allows(make_engine: EngineFactory) -> None:
    engine = make_engine()
    choice = StructuredOutputs.choice(["yes", "no"])
    engine.add_request("a", PROMPT, constrained(choice, logprobs=5))
    output = run_outputs(engine)["a"].outputs[0]
    assert output.logprobs is not None
    first = output.logprobs[0]
    finite = {t: lp for t, lp in first.items() if lp != float("-inf")}
    matcher = engine._grammar.compiler.compile(choice).result()
    allowed = allowed_tokens(matcher, TINY_VOCAB)
    assert set(finite) <= allowed and output.token_ids[0] in finite
    # The allowed tokens share all the probability (at most 5 of them are listed).
    assert sum(torch.tensor(list(finite.values())).exp()) <= 1.0 + 1e-5
    if len(allowed) <= 5:
        assert abs(float(torch.tensor(list(finite.values())).exp().sum()) - 1.0) < 1e-4


def test_min_tokens_holds_eos_back_until_the_grammar_can_only_end(
    make_engine: EngineFactory,
) -> None:
    """min_tokens refuses EOS while the grammar allows something else; at the grammar's end
    (EOS all it allows, or nothing more at all) the grammar wins."""
    engine = make_engine()
    push_eos = {EOS: 100.0}  # after the mask: EOS wherever the grammar allows it
    regex = StructuredOutputs(StructuredKind.REGEX, "ab*")
    engine.add_request("short", PROMPT, constrained(regex, logit_bias=push_eos))
    engine.add_request("min", PROMPT, constrained(regex, logit_bias=push_eos, min_tokens=4))
    engine.add_request(
        "ignore", PROMPT, constrained(regex, logit_bias=push_eos, ignore_eos=True, max_tokens=9)
    )
    engine.add_request(
        "end", PROMPT, constrained(StructuredOutputs.choice(["yes"]), min_tokens=5, max_tokens=9)
    )
    done = run_outputs(engine)
    a, b = 3 + ord("a") - 32, 3 + ord("b") - 32
    assert done["short"].outputs[0].token_ids == [a, EOS]
    assert done["min"].outputs[0].token_ids == [a, b, b, b, EOS]
    # ignore_eos: EOS does not stop a sample, but the grammar it completes does.
    assert done["ignore"].outputs[0].token_ids == [a, EOS]
    assert len(done["end"].outputs[0].token_ids) < 5
    for rid in done:
        assert done[rid].outputs[0].finish_reason == "stop", rid
    assert_pool_whole(engine)


def test_a_grammar_that_cannot_compile_fails_only_its_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    bad = StructuredOutputs(StructuredKind.GRAMMAR, 'root ::= "a" missing_rule')
    engine.add_request("ok", PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
    engine.add_request("bad", PROMPT, constrained(bad, n=2))
    engine.add_request("json", PROMPT, constrained(JSON))
    done = run_outputs(engine)
    assert done["bad"].error is not None
    assert done["bad"].error.startswith("structured_outputs")
    assert "missing_rule" in done["bad"].error
    assert [o.finish_reason for o in done["bad"].outputs] == ["abort", "abort"]
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 5
    assert done["json"].error is None and done["json"].outputs[0].finish_reason == "stop"
    assert_pool_whole(engine)


def test_a_model_without_a_tokenizer_fails_constrained_requests_alone(
    make_engine: EngineFactory, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    engine = make_engine()
    engine._grammar.compiler.model_path = str(tmp_path)  # a folder with no tokenizer files
    engine.add_request("json", PROMPT, constrained(JSON))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=3))
    done = run_outputs(engine)
    assert done["json"].error is not None and "tokenizer" in done["json"].error
    assert len(done["free"].outputs[0].token_ids) == 3
    assert_pool_whole(engine)


def test_abort_while_compiling(make_engine: EngineFactory) -> None:
    """A held request counts as work, can be aborted before its grammar is ready, and the
    compile that ends later changes nothing."""
    engine = make_engine()
    compiler = engine._grammar.compiler
    with compiler._tokenizer_lock:  # the compile waits for the vocabulary: held for now
        engine.add_request("a", PROMPT, constrained(JSON))
        assert engine.has_work() and engine.has_unfinished_requests()
        assert engine.step() == [] and engine.has_work()
        aborted = engine.abort("a")
        assert aborted is not None and aborted.finished
        assert aborted.outputs[0].finish_reason == "abort"
        assert not engine.has_work() and not engine.has_unfinished_requests()
    future = compiler.compile(JSON)
    future.result(timeout=30)
    assert engine.step() == [] and not engine.has_work()
    assert_pool_whole(engine)


def test_compiled_grammars_are_shared_and_bounded(make_engine: EngineFactory) -> None:
    engine = make_engine()
    for i in range(3):
        engine.add_request(f"j{i}", PROMPT, constrained(JSON, temperature=1.0, seed=i))
    run_outputs(engine)
    compiler = engine._grammar.compiler
    assert compiler.num_compiled == 1
    small = GrammarCompiler(compiler.model_path, TINY_VOCAB, (EOS,), max_cached=2)
    for choice in (["a"], ["b"], ["c"], ["a"]):
        small.compile(StructuredOutputs.choice(choice)).result()
    assert small.num_compiled == 4  # "a" fell out of the two kept
    small.shutdown()


def test_preempted_constrained_requests_keep_their_grammar_state(
    make_engine: EngineFactory, tiny_llama_dir: Path
) -> None:
    """A pool too small for all of them: samples are preempted and recomputed mid-grammar,
    and give the tokens they give with room to spare."""
    params = [constrained(JSON, temperature=0.8, seed=i, max_tokens=60) for i in range(6)]
    roomy = make_engine()
    small = make_engine(num_blocks=24, max_num_batched_tokens=16)
    for engine in (roomy, small):
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", PROMPT + [i + 3] * 20, p)
    expected, got = run_outputs(roomy), run_outputs(small)
    assert small.stats().num_preemptions > 0, "the pool was meant to force preemption"
    for rid, output in got.items():
        assert output.outputs[0].token_ids == expected[rid].outputs[0].token_ids, rid
        check_schema(json.loads(decode(tiny_llama_dir, output.outputs[0].token_ids)))
    for engine in (roomy, small):
        assert_pool_whole(engine)


def test_compiling_runs_off_the_engine_thread(make_engine: EngineFactory) -> None:
    engine = make_engine()
    compiler = engine._grammar.compiler
    threads: list[str] = []
    compile_one = compiler._compile

    def recorded(constraint: StructuredOutputs) -> Any:
        threads.append(threading.current_thread().name)
        return compile_one(constraint)

    compiler._compile = recorded  # type: ignore[method-assign]
    engine.add_request("a", PROMPT, constrained(StructuredOutputs.choice(["x"])))
    run_outputs(engine)
    assert threads and threads[0].startswith("grammar")
