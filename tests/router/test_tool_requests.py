"""Tool calling's request side: tools, tool_choice and parallel_tool_calls checked field by field
(router/tool_requests.py), the forced call's schema compiled by the real grammar engine, the
tool role and tool_calls in messages, and the prompt the real default model's tokenizer renders
with tools, with its own template (which ignores tools) and with one that reads them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvrelay.common.grammar import check_grammar
from kvrelay.common.structured_outputs import StructuredKind
from kvrelay.router.prompt_encoder import PromptEncoder
from kvrelay.router.prompts import chat_messages
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.tool_messages import hermes_messages, template_takes_tools
from kvrelay.router.tool_requests import ToolChoice, calls_schema, tool_plan

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


def tool(name: str, parameters: Any = None, **function: Any) -> dict[str, Any]:
    function = {"name": name, **function}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("get_weather", WEATHER_PARAMETERS, description="Weather"), tool("now")]


def refused(fn: Any, *args: Any, **kwargs: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args, **kwargs)
    return info.value


# -- tools, tool_choice, parallel_tool_calls -------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        ([None], "tools.0"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type"),
        ([{"type": "function"}], "tools.0.function"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools.0.extra"),
        ([tool("f"), tool("bad name")], "tools.1.function.name"),
        ([tool("")], "tools.0.function.name"),
        ([tool("x" * 65)], "tools.0.function.name"),
        ([{"type": "function", "function": {"parameters": {}}}], "tools.0.function.name"),
        ([tool("f"), tool("g"), tool("f")], "tools.2.function.name"),
        ([tool("f", [1])], "tools.0.function.parameters"),
        ([tool("f", {"type": "string"})], "tools.0.function.parameters"),
        ([tool("f", {"type": "object", "properties": {"a": {"type": "strin"}}})],
         "tools.0.function.parameters"),
        ([tool("f", description=3)], "tools.0.function.description"),
        ([tool("f", strict="yes")], "tools.0.function.strict"),
        ([tool("f", examples=[])], "tools.0.function.examples"),
        ([tool(f"f{i}") for i in range(129)], "tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(tools: Any, param: str) -> None:
    error = refused(tool_plan, tools)
    assert error.param == param, error.message
    assert error.status.http_status == 400


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ("sometimes", "tool_choice"),
        ("function", "tool_choice"),
        (3, "tool_choice"),
        ({"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
        ({"type": "function", "function": "get_weather"}, "tool_choice.function"),
        ({"type": "function", "name": "get_weather"}, "tool_choice.function"),
        ({"type": "tool", "function": {"name": "get_weather"}}, "tool_choice"),
    ],
)
def test_bad_tool_choice_is_refused_naming_the_field(choice: Any, param: str) -> None:
    assert refused(tool_plan, TOOLS, choice).param == param


def test_required_or_named_need_tools_and_parallel_is_a_bool() -> None:
    assert refused(tool_plan, None, "required").param == "tool_choice"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert refused(tool_plan, [], named).param == "tool_choice.function.name"
    assert refused(tool_plan, TOOLS, "auto", "yes").param == "parallel_tool_calls"


@pytest.mark.parametrize("field", ["functions", "function_call"])
def test_the_deprecated_function_fields_are_refused_by_name(field: str) -> None:
    error = refused(tool_plan, None, **{field: [] if field == "functions" else "auto"})
    assert error.param == field and "deprecated" in error.message


def test_defaults_follow_openai() -> None:
    assert tool_plan(None).choice is ToolChoice.NONE
    auto = tool_plan(TOOLS)
    assert auto.choice is ToolChoice.AUTO and auto.parallel and auto.parses_calls
    assert auto.structured_outputs() is None
    assert not tool_plan(TOOLS, "none").parses_calls
    assert tool_plan(TOOLS, "none").template_tools() is not None  # shown, as vLLM does
    assert tool_plan(TOOLS, "auto", False).max_calls == 1


def test_a_named_choice_constrains_to_the_functions_parameters() -> None:
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    constraint = plan.structured_outputs()
    assert constraint is not None and constraint.kind is StructuredKind.JSON
    assert json.loads(constraint.spec) == WEATHER_PARAMETERS
    no_arguments = tool_plan(TOOLS, {"type": "function", "function": {"name": "now"}})
    spec = no_arguments.structured_outputs()
    assert spec is not None and json.loads(spec.spec)["additionalProperties"] is False


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_an_array_of_calls(parallel: bool) -> None:
    plan = tool_plan(TOOLS, "required", parallel)
    constraint = plan.structured_outputs()
    assert constraint is not None
    schema = json.loads(constraint.spec)
    assert schema == calls_schema(plan.functions, parallel)
    assert schema["minItems"] == 1 and schema.get("maxItems") == (None if parallel else 1)
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    first = schema["items"]["anyOf"][0]
    assert list(first["properties"]) == ["name", "arguments"]  # the name is written first
    assert first["properties"]["arguments"] == WEATHER_PARAMETERS
    check_grammar(constraint)  # the real grammar engine compiles it


def test_a_constraint_from_another_field_is_refused_with_tool_choice() -> None:
    plan = tool_plan(TOOLS, "required")
    fields: dict[str, Any] = {"structured_outputs": object()}
    names = {"structured_outputs": "response_format"}
    error = refused(plan.constrain, fields, names)
    assert error.param == "tool_choice" and "response_format" in error.message
    fields, names = {"structured_outputs": None}, {}
    plan.constrain(fields, names)
    assert fields["structured_outputs"] == plan.structured_outputs()
    assert names == {"structured_outputs": "tool_choice"}


# -- messages --------------------------------------------------------------------------------------

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_tool_turns_are_checked_and_arguments_parsed() -> None:
    checked = chat_messages(TURNS, tools=True)
    assert checked[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert checked[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
    # A wire without tools (gRPC) refuses the role.
    assert refused(chat_messages, TURNS).param == "messages.2.role"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages.0.tool_call_id"),
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages.0.tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "a"}, "messages.0.tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": CALL}, "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": [3]}, "messages.0.tool_calls.0"),
        ({"role": "assistant", "tool_calls": [{**CALL, "type": "x"}]},
         "messages.0.tool_calls.0.type"),
        ({"role": "assistant", "tool_calls": [{"id": "a"}]}, "messages.0.tool_calls.0.function"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
         "messages.0.tool_calls.0.function.name"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
         "messages.0.tool_calls.0.function.arguments"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
         "messages.0.tool_calls.0.function.arguments"),
        ({"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}, "messages.0.tool_calls.0.id"),
    ],
)  # fmt: skip
def test_bad_tool_turns_are_named(message: dict[str, Any], param: str) -> None:
    assert refused(chat_messages, [message], tools=True).param == param


# -- the prompt ------------------------------------------------------------------------------------

# A template that reads tools, as the Qwen family's does (shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    encoder = PromptEncoder(tokenizer, 8192)
    try:
        checked = chat_messages(messages, tools=True)
        text, ids = asyncio.run(encoder.render_chat(checked, True, tools))
    finally:
        encoder.close()
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    return text


def test_the_default_template_gets_a_hermes_instruction(tokenizer: Any) -> None:
    assert not template_takes_tools(tokenizer.chat_template)
    tools = tool_plan(TOOLS).template_tools()
    text = render(tokenizer, TURNS, tools)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "trained by Hugging Face" not in text  # the instruction is the system turn
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_system_message_keeps_its_text_before_the_instruction(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *TURNS[:1]]
    text = render(tokenizer, messages, tool_plan(TOOLS).template_tools())
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # Without tools nor tool turns the template is used as it is.
    plain = render(tokenizer, messages, None)
    assert plain == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_consecutive_tool_results_are_one_user_turn() -> None:
    turns = [
        *chat_messages(TURNS, tools=True),
        {"role": "tool", "content": "more", "tool_call_id": "c"},
    ]
    out = hermes_messages(turns, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[2]["content"].count("<tool_response>") == 2


def test_a_template_that_reads_tools_renders_them_itself(tokenizer: Any) -> None:
    assert template_takes_tools(TOOLS_TEMPLATE)
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOLS_TEMPLATE
    try:
        text = render(tokenizer, TURNS, tool_plan(TOOLS).template_tools())
    finally:
        tokenizer.chat_template = original
    assert text.startswith("<|im_start|>system\nTOOLS:get_weather;now;<|im_end|>\n")
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments as an object
    assert "<tool_response>" not in text and "# Tools" not in text


def test_tool_turns_without_tools_are_still_written_out(tokenizer: Any) -> None:
    """A follow-up turn may leave `tools` out: the calls and results still reach the prompt
    (the default template would fail on a null content and drop tool_calls)."""
    text = render(tokenizer, TURNS, None)
    assert "# Tools" not in text
    assert '<tool_call>\n{"name": "get_weather"' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_an_unparsable_template_is_read_for_the_word_tools() -> None:
    assert template_takes_tools("{% if tools %}{{ x }")
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}")
    assert not template_takes_tools(None) and not template_takes_tools("")
    # A template that sets its own `tools` variable does not read the client's.
    assert not template_takes_tools("{% set tools = [] %}{{ tools }}")
