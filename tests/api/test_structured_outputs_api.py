"""Structured outputs end to end (issue 39), with the real `openai` client against real servers,
colocated and prefill/decode: `response_format: json_schema` gives schema-valid JSON greedy and
sampled, streamed and not, n = 2; vLLM's guided_choice / guided_regex hold; a constraint that
cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.servers import ServerProcess, start_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person who lives in Europe, as JSON."}]
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture(scope="module")
def colocated_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("colocated"), "--colocated")
    yield server
    server.stop()


@pytest.fixture(params=["colocated", "prefill-decode"])
def server(request: pytest.FixtureRequest) -> ServerProcess:
    name = "colocated_server" if request.param == "colocated" else "kvrelay_server"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)


def _texts(server: ServerProcess, stream: bool, **options: Any) -> list[str]:
    """Each choice's whole content, streamed or not."""
    client = _client(server)
    args: dict[str, Any] = {"model": server.model, "messages": ASK, "max_tokens": 120, **options}
    if not stream:
        reply = client.chat.completions.create(**args)
        return [c.message.content or "" for c in sorted(reply.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return [texts[i] for i in sorted(texts)]


@pytest.mark.parametrize(
    ("sampling", "stream", "n"),
    [
        ({"temperature": 0}, False, 1),
        ({"temperature": 0}, True, 2),
        ({"temperature": 1.0, "seed": 7}, False, 2),
        ({"temperature": 1.0, "seed": 11}, True, 1),
    ],
    ids=["greedy", "greedy-stream-n2", "sampled-n2", "sampled-stream"],
)
def test_json_schema_replies_are_valid_json(
    server: ServerProcess, sampling: dict[str, Any], stream: bool, n: int
) -> None:
    texts = _texts(server, stream, response_format=FORMAT, n=n, **sampling)
    assert len(texts) == n
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_without_a_constraint_the_model_writes_prose(colocated_server: ServerProcess) -> None:
    """The check above can fail: the same request unconstrained is not the schema's JSON."""
    text = _texts(colocated_server, False, temperature=0)[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_seeded_samples_repeat(colocated_server: ServerProcess) -> None:
    fmt = {"type": "json_object"}
    first = _texts(colocated_server, False, response_format=fmt, temperature=1.0, seed=3)
    again = _texts(colocated_server, True, response_format=fmt, temperature=1.0, seed=3)
    assert first == again
    assert isinstance(json.loads(first[0]), dict)


def test_guided_choice_and_regex(server: ServerProcess) -> None:
    choices = ["positive", "negative"]
    text = _texts(server, False, temperature=0, extra_body={"guided_choice": choices})[0]
    assert text in choices
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    completion = _client(server).completions.create(
        model=server.model,
        prompt="A product code:",
        max_tokens=20,
        temperature=1.0,
        seed=5,
        extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, completion.choices[0].text), completion.choices[0].text


def test_structured_outputs_object_with_a_grammar(colocated_server: ServerProcess) -> None:
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    extra = {"structured_outputs": {"grammar": grammar}}
    text = _texts(colocated_server, True, temperature=0, extra_body=extra)[0]
    assert text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}},
         "structured_outputs.grammar"),
        ({"extra_body": {"guided_json": {"$ref": "#/nope"}}}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
         "guided_choice"),
        ({"extra_body": {"guided_choice": ["a"], "guided_decoding_backend": "outlines"}},
         "guided_decoding_backend"),
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(
    colocated_server: ServerProcess, options: dict[str, Any], param: str
) -> None:
    client = _client(colocated_server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=colocated_server.model, messages=ASK, **options)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]
