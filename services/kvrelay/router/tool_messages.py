"""Tool calling in the conversation: the `tool` role and assistant `tool_calls` checked (an
InvalidRequestError naming e.g. `messages.2.tool_call_id`), and the conversation rendered for a
chat template that knows nothing of tools (the default model's): the tools listed in a
Hermes-style system instruction, earlier calls written as `<tool_call>` JSON in the assistant's
text, results as `<tool_response>` in a user turn. The parser of `auto` replies
(kvrelay.api.tool_calls) reads the same format back.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay.router.request_errors import InvalidRequestError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

_INSTRUCTION = """# Tools

You may call one or more functions to help with the user's request. The functions you can \
call are described by the JSON signatures within <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, reply with a JSON object holding its name and its arguments within \
<tool_call></tool_call> tags, one call per tag pair:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-object>}}
</tool_call>"""


def tool_fields(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """The tool fields of checked message `index`: a tool message's `tool_call_id`, an
    assistant message's `tool_calls` (arguments parsed to objects, as chat templates take
    them)."""
    role = message.get("role")
    param = f"messages.{index}"
    call_id = message.get("tool_call_id")
    if role == "tool" or call_id is not None:
        if role != "tool":
            raise InvalidRequestError(
                f"{param}.tool_call_id belongs on a tool message", f"{param}.tool_call_id"
            )
        return {"tool_call_id": _text(call_id, f"{param}.tool_call_id")}
    calls = message.get("tool_calls")
    if calls is None:
        return {}
    if role != "assistant":
        raise InvalidRequestError(
            f"{param}.tool_calls belongs on an assistant message", f"{param}.tool_calls"
        )
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
    return {"tool_calls": [_call(c, f"{param}.tool_calls.{j}") for j, c in enumerate(calls)]}


def _call(call: Any, param: str) -> dict[str, Any]:
    """{"id", "type": "function", "function": {"name", "arguments": JSON text}}, checked."""
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{param} must be an object", param)
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f'{param}.type must be "function"', f"{param}.type")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"{param}.function must be an object", f"{param}.function")
    name = _text(function.get("name"), f"{param}.function.name")
    arguments = function.get("arguments", "{}")
    where = f"{param}.function.arguments"
    try:
        parsed = json.loads(_text(arguments, where)) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, as text", where)
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": parsed}}
    if call.get("id") is not None:
        out["id"] = _text(call.get("id"), f"{param}.id")
    return out


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{param} is not valid Unicode text", param) from None
    return value


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (if it does, it renders the tools,
    calls and results itself)."""
    if not template:
        return False
    return _reads_tools(template)


@functools.lru_cache(maxsize=8)
def _reads_tools(template: str) -> bool:
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "tools" in template
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def needs_tool_rendering(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the conversation holds tool calls or results."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """The conversation in plain system/user/assistant turns for a template without tools:
    the tools' instruction joined to the system message (or a new one first), calls as
    `<tool_call>` text, consecutive tool results as one user turn of `<tool_response>`s."""
    out: list[dict[str, str]] = []
    responses_at = -1  # the index in `out` of the user turn that takes tool results
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if responses_at == len(out) - 1 and responses_at >= 0:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
                responses_at = len(out) - 1
            continue
        if message.get("tool_calls"):
            calls = [_call_text(call["function"]) for call in message["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": role, "content": content})
    if tools:
        instruction = tool_instruction(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{instruction}"
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out


def _call_text(function: Mapping[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def tool_instruction(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system instruction that lists `tools` (OpenAI's shape) and the call format."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _INSTRUCTION.format(signatures=signatures)
