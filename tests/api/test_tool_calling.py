"""Tool calling with the real `openai` client against a real `kvrelay serve` (the session's
shared server, default model): `required` and named choices return tool_calls whose arguments
satisfy the function's schema, whole and streamed; a follow-up turn with the calls and a `tool`
message is answered; `auto` parses the model's own `<tool_call>` text (forced here with a
regex, since the default model rarely writes one) and returns plain text as content."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(kvrelay_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{kvrelay_server.http_url}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, **fields: Any) -> Any:
    fields = {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **fields}
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", **fields)


def check_call(call: Any, names: tuple[str, ...] = ("get_weather", "get_time")) -> Any:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def collect_stream(stream: Any) -> dict[int, dict[str, Any]]:
    """Per choice: content, calls (id, name, arguments joined), finish_reason; and checks
    that each call's first delta holds id, type and name, and the later ones do not."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            got = out.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                call = got["calls"].get(entry.index)
                if call is None:
                    assert entry.id.startswith("call_") and entry.type == "function"
                    assert entry.function.name
                    call = got["calls"][entry.index] = {
                        "id": entry.id,
                        "name": entry.function.name,
                        "arguments": "",
                    }
                else:
                    assert entry.id is None and entry.function.name is None
                call["arguments"] += entry.function.arguments or ""
            got["finish"] = choice.finish_reason or got["finish"]
    return out


def test_required_returns_a_schema_valid_call(client: openai.OpenAI) -> None:
    reply = ask(client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls  # one call: the default model writes one here
    check_call(call)


def test_named_returns_that_function_whole_and_streamed(client: openai.OpenAI) -> None:
    reply = ask(client, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = check_call(call, ("get_weather",))
    stream = collect_stream(ask(client, tool_choice=NAMED, stream=True))
    (streamed_call,) = stream[0]["calls"].values()
    assert streamed_call["name"] == "get_weather"
    assert json.loads(streamed_call["arguments"]) == arguments  # greedy: the same call
    assert stream[0]["content"] == "" and stream[0]["finish"] == "tool_calls"


def test_required_streamed_with_two_samples_parses_each(client: openai.OpenAI) -> None:
    stream = collect_stream(
        ask(client, tool_choice="required", stream=True, n=2, temperature=1.0, seed=7)
    )
    assert sorted(stream) == [0, 1]
    for got in stream.values():
        assert got["finish"] == "tool_calls" and got["calls"], got
        for call in got["calls"].values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_without_parallel_calls_required_makes_one_call(client: openai.OpenAI) -> None:
    reply = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, n=2)
    for choice in reply.choices:
        (call,) = choice.message.tool_calls
        check_call(call)


def test_a_tool_result_turn_is_answered(client: openai.OpenAI) -> None:
    first = ask(client, tool_choice=NAMED).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = ask(client, messages=messages, tool_choice="none", max_tokens=30)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    # The tool turn is in the prompt: it is longer than the same turns without the result.
    shorter = ask(client, messages=messages[:2], tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > shorter.usage.prompt_tokens + 10


def test_auto_returns_the_models_text_as_content(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    auto = ask(client, messages=messages, max_tokens=12)
    none = ask(client, messages=messages, max_tokens=12, tool_choice="none")
    choice = auto.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == none.choices[0].message.content  # same prompt, greedy
    assert choice.finish_reason in ("stop", "length")


# The model's own Hermes output, forced by a regex so the default model writes one.
HERMES_REPLY = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_tool_call(client: openai.OpenAI, stream: bool) -> None:
    reply = ask(client, stream=stream, extra_body={"guided_regex": HERMES_REPLY})
    if stream:
        (got,) = collect_stream(reply).values()
        (call,) = got["calls"].values()
        content, name, arguments = got["content"], call["name"], call["arguments"]
        finish = got["finish"]
    else:
        choice = reply.choices[0]
        (tool_call,) = choice.message.tool_calls
        content, finish = choice.message.content, choice.finish_reason
        name, arguments = tool_call.function.name, tool_call.function.arguments
    assert content == "Let me check."
    assert name == "get_weather" and finish == "tool_calls"
    assert json.loads(arguments) in ({"city": c, "unit": "celsius"} for c in ("Paris", "Rome"))


def test_auto_keeps_a_malformed_call_as_content(client: openai.OpenAI) -> None:
    text = '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'
    pattern = text.replace("{", r"\{").replace("}", r"\}")
    reply = ask(client, extra_body={"guided_regex": pattern})
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools.0.function.name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools.2.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
         "tools.0.function.parameters"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        ({"extra_body": {"function_call": "auto"}}, "function_call"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_a_400_naming_them(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, **fields)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error"
