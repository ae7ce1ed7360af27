"""Structured outputs in the SDK (issue 39): the `structured_outputs` keyword on the wire, and
over gRPC against the real server (prefill/decode): a JSON schema, a choice and a regex hold,
streamed and not; a constraint that cannot compile is INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest

from kvrelay.client import AsyncClient, Client, InvalidArgumentError, StructuredOutputs
from kvrelay.client.convert import sampling_options
from kvrelay.common.structured_outputs import StructuredKind

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("value", "field", "wire"),
    [
        ({"json": SCHEMA}, "json", json.dumps(SCHEMA)),
        ({"json": '{"type": "object"}'}, "json", '{"type": "object"}'),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"grammar": 'start: "a"'}, "grammar", 'start: "a"'),
        ({"json_object": True, "any_whitespace": True}, "json_object", True),
        (StructuredOutputs.json_schema({"type": "object"}), "json", '{"type":"object"}'),
        (StructuredOutputs(StructuredKind.JSON_OBJECT), "json_object", True),
        (StructuredOutputs(StructuredKind.REGEX, "a|b"), "regex", "a|b"),
    ],
)
def test_structured_outputs_reach_the_wire(value: Any, field: str, wire: object) -> None:
    message = sampling_options({"structured_outputs": value}).structured_outputs
    assert message.WhichOneof("constraint") == field
    assert getattr(message, field) == wire
    flexible = isinstance(value, dict) and value.get("any_whitespace", False)
    assert message.any_whitespace == flexible


def test_choice_reaches_the_wire_as_a_list() -> None:
    for value in ({"choice": ["yes", "no"]}, StructuredOutputs.choice(["yes", "no"])):
        message = sampling_options({"structured_outputs": value}).structured_outputs
        assert list(message.choice.values) == ["yes", "no"]


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"regex": "a", "choice": ["a"]},
        {"regex": "a", "whitespace_pattern": " "},
        {"choice": "ab"},
        {"choice": ["a", 1]},
        {"regex": 3},
        "[a-z]+",
    ],
)
def test_what_the_wire_cannot_carry_is_refused_before_sending(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="structured_outputs"):
        sampling_options({"structured_outputs": value})


@pytest.fixture(scope="module")
def client(kvrelay_server: Any) -> Any:
    with Client(kvrelay_server.grpc_target, timeout=120.0) as c:
        yield c


def test_json_schema_choice_and_regex_over_grpc(client: Client) -> None:
    result = client.generate(
        "A user record:", max_tokens=80, temperature=0, structured_outputs={"json": SCHEMA}
    )
    jsonschema.validate(json.loads(result.text), SCHEMA)
    chat = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    answers = client.chat(chat, n=2, temperature=1.0, seed=3, max_tokens=8,
                          structured_outputs=StructuredOutputs.choice(["yes", "no"]))  # fmt: skip
    assert {c.text for c in answers.choices} <= {"yes", "no"}
    text = "".join(
        chunk.choices[0].text if chunk.choices else ""
        for chunk in client.generate(
            "Code:", max_tokens=12, stream=True, structured_outputs={"regex": "[A-Z]{2}[0-9]{2}"}
        )
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", text), text


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"regex": "(["}, "sampling.structured_outputs.regex"),
        ({"json": '{"type": "objekt"}'}, "sampling.structured_outputs.json"),
        ({"json": "not json"}, "sampling.structured_outputs.json"),
        ({"json_object": False}, "sampling.structured_outputs.json_object"),
    ],
)
def test_a_bad_constraint_is_invalid_argument_naming_it(
    client: Client, value: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        client.generate("x", max_tokens=4, structured_outputs=value)
    assert field in refused.value.details


def test_async_client_carries_the_constraint(kvrelay_server: Any) -> None:
    async def run() -> str:
        async with AsyncClient(kvrelay_server.grpc_target, timeout=120.0) as c:
            result = await c.generate(
                "Pick:", max_tokens=8, temperature=0, structured_outputs={"choice": ["x", "y"]}
            )
            return result.text

    assert asyncio.run(run()) in ("x", "y")
