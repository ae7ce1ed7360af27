"""Structured outputs on the real default model (SmolLM2-135M-Instruct) through the offline
API and a worker-style engine (no tokenizer of its own: the grammar compiler loads the
folder's): JSON that parses and meets its schema, greedy, sampled and n = 2; regex, choice
and a GBNF grammar; unconstrained neighbours unchanged; a tight KV pool; no leaked block."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from kvrelay.engine.args import EngineArgs
from tests.engine.conftest import assert_pool_whole, run_to_completion

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = "Describe a person who lives in a big city as a JSON object with name, age and city."


def check_person(value: Any) -> None:
    """PERSON, checked by hand."""
    assert isinstance(value, dict) and {"name", "age", "city"} <= set(value) <= {
        *PERSON["properties"]
    }  # type: ignore[misc]
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert 0 <= value["age"] <= 150 and value["city"] in ("Paris", "London", "Tokyo")
    tags = value.get("tags", [])
    assert isinstance(tags, list) and len(tags) <= 3
    assert all(isinstance(t, str) and len(t) <= 12 for t in tags)


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(default_model_dir), max_num_batched_tokens=128, kv_cache_memory="64MiB")
    yield llm
    assert_pool_whole(llm.engine)


def person(**kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputs.json_schema(PERSON), **kwargs)


def test_json_schema_greedy_sampled_and_n2(llm: LLM) -> None:
    prompt = llm.chat_prompt([{"role": "user", "content": ASK}])
    params = [
        person(temperature=0.0),
        person(temperature=0.8, seed=1),
        person(temperature=1.0, top_p=0.95, seed=2, n=2),
    ]
    outputs = llm.generate([prompt] * 3, params, use_tqdm=False)
    samples = [s for out in outputs for s in out.outputs]
    assert len(samples) == 4
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        check_person(json.loads(sample.text))
    assert samples[2].text != samples[3].text or samples[2].token_ids != samples[3].token_ids


def test_regex_choice_and_gbnf(llm: LLM) -> None:
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    gbnf = (
        'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,40} "."'
    )
    cases = {
        "When did the first humans land on the Moon? Give the date.": StructuredOutputs(
            StructuredKind.REGEX, date
        ),
        "Is the sky blue? Answer yes or no.": StructuredOutputs.choice(["yes", "no"]),
        "Is water wet? Answer and say why.": StructuredOutputs(StructuredKind.GRAMMAR, gbnf),
    }
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in cases]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c) for c in cases.values()
    ]
    texts = [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]
    assert re.fullmatch(date, texts[0]), texts[0]
    assert texts[1] in ("yes", "no")
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,40}\.", texts[2]), texts[2]


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    prompts = ["The capital of France is", "List three fruits:"]
    free = SamplingParams(temperature=0.0, max_tokens=16)
    seeded = SamplingParams(temperature=0.9, seed=4, max_tokens=16)
    alone = llm.generate(prompts, [free, seeded], use_tqdm=False)
    ask = llm.chat_prompt([{"role": "user", "content": ASK}])
    mixed = llm.generate(
        [ask, *prompts, ask],
        [person(temperature=0.0), free, seeded, person(temperature=0.7, seed=3)],
        use_tqdm=False,
    )
    for before, after in zip(alone, mixed[1:3], strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    for out in (mixed[0], mixed[3]):
        check_person(json.loads(out.outputs[0].text))


def test_a_worker_engine_loads_the_tokenizer_for_its_first_grammar(
    default_model_dir: Path, llm: LLM
) -> None:
    """Built as a worker builds it (no tokenizer), in a pool small enough to preempt: the
    same greedy tokens as the offline API's, every block freed."""
    engine = EngineArgs(
        model=str(default_model_dir), num_blocks=8, block_size=16, max_num_batched_tokens=32
    ).create_engine(with_tokenizer=False)
    assert engine.tokenizer is None
    prompt = llm.chat_prompt([{"role": "user", "content": ASK}])
    ids = prompt["prompt_token_ids"]
    assert len(ids) + 60 < 8 * 16  # one request alone fits (its JSON takes ~30 tokens)
    for i in range(4):
        engine.add_request(f"r{i}", ids, person(temperature=0.0 if i == 0 else 0.8, seed=i))
    done = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    expected = llm.generate([prompt], person(temperature=0.0), use_tqdm=False)[0]
    assert done["r0"][0] == expected.outputs[0].token_ids
    for i in range(4):
        check_person(json.loads(llm.get_tokenizer().decode(done[f"r{i}"][0])))
    assert_pool_whole(engine)


def test_a_schema_llguidance_refuses_fails_its_request_alone(llm: LLM) -> None:
    bad = StructuredOutputs(StructuredKind.REGEX, "[z-a]")
    outs = llm.generate(
        ["Hi", "Hello"],
        [SamplingParams(structured_outputs=bad), SamplingParams(temperature=0.0, max_tokens=4)],
        use_tqdm=False,
    )
    assert outs[0].error is not None and outs[0].error.startswith("structured_outputs")
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
