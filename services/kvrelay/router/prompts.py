"""The one validator of what a client sent, for both APIs: prompt text, chat messages and
sampling fields become a prompt and SamplingParams, or an InvalidRequestError naming the field
exactly as the client spelled it (HTTP and gRPC spell some fields differently: `field_names`).

The wire layers only parse their format (JSON types, protobuf); every rule lives here or in
SamplingParams and Router.check_request, so both APIs refuse exactly the same requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.tool_messages import tool_fields

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}
# OpenAI's chat roles we can render ("developer" is OpenAI's newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant")
# With tool calling (the HTTP API): a tool's result, and assistant messages' tool_calls.
TOOL_CHAT_ROLES = (*CHAT_ROLES, "tool")
MAX_NAME_CHARS = 256
# A client's own request id (echoed back, never a key: router/types.py).
MAX_LABEL_CHARS = 256


def sampling_params(
    fields: Mapping[str, Any], field_names: Mapping[str, str] | None = None
) -> SamplingParams:
    """SamplingParams from request fields; unset (None) ones keep vLLM's defaults. An error
    names the field by its wire name (`field_names`, default: the same name)."""
    names = field_names or {}
    kwargs = {k: v for k, v in fields.items() if v is not None}
    unknown = set(kwargs) - _SAMPLING_FIELDS
    if unknown:
        raise InvalidRequestError(f"unknown sampling fields: {', '.join(sorted(unknown))}")
    for stop in kwargs.get("stop") or ():
        if isinstance(stop, str):
            check_text(stop, names.get("stop", "stop"))
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        if field not in _SAMPLING_FIELDS:
            raise InvalidRequestError(str(exc)) from exc
        wire = names.get(field, field)
        message = str(exc) if wire == field else f"{wire}{str(exc)[len(field) :]}"
        raise InvalidRequestError(message, wire) from exc


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the context
    length's worth); None keeps it whole. A prompt so cut must still leave room for its output
    (Router.check_request says so)."""
    if keep is None:
        return ids
    param = "truncate_prompt_tokens"
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise InvalidRequestError(f"{param} must be -1 or at least 1, got {keep}", param)
    if keep > max_model_len:
        raise InvalidRequestError(
            f"{param}={keep} is more than this model's context length of {max_model_len} "
            "tokens: use -1 for the whole context",
            param,
        )
    return ids[-keep:]


def client_label(label: str | None, param: str = "request_id") -> str | None:
    """A client's own request id, checked: at most MAX_LABEL_CHARS of valid Unicode (None or
    empty: none sent)."""
    if not label:
        return None
    if len(label) > MAX_LABEL_CHARS:
        raise InvalidRequestError(f"{param} is longer than {MAX_LABEL_CHARS} characters", param)
    return check_text(label, param)


def check_text(text: str, param: str) -> str:
    """Refuse text that is not valid Unicode (a lone surrogate from a JSON escape such as
    "\\ud800"): the tokenizer cannot encode it, and it must not reach the engine."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode text (a lone surrogate at character {exc.start})",
            param,
        ) from None
    return text


def chat_messages(
    messages: Sequence[Mapping[str, Any]], tools: bool = False
) -> list[dict[str, Any]]:
    """Chat messages as the template takes them ({"role", "content"}), each checked: a known
    role, text content. `content` may be OpenAI's list of {"type": "text", "text"} parts.
    With `tools` (a wire that carries them): the `tool` role and assistant `tool_calls` too
    (router.tool_messages)."""
    if not messages:
        raise InvalidRequestError("messages is empty: send at least one message", "messages")
    return [_chat_message(i, m, tools) for i, m in enumerate(messages)]


def _chat_message(index: int, message: Mapping[str, Any], tools: bool) -> dict[str, Any]:
    role = message.get("role")
    roles = TOOL_CHAT_ROLES if tools else CHAT_ROLES
    if role not in roles:
        raise InvalidRequestError(
            f"messages.{index}.role must be one of {', '.join(roles)}, got {role!r}",
            f"messages.{index}.role",
        )
    content = message.get("content")
    param = f"messages.{index}.content"
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{param}.{j}") for j, part in enumerate(content))
    if content is not None and not isinstance(content, str):
        raise InvalidRequestError(f"{param} must be a string or a list of text parts", param)
    checked = {
        "role": "system" if role == "developer" else role,
        "content": check_text(content or "", param),
    }
    name = message.get("name")
    if name is not None:  # OpenAI's participant name: templates that read it get it
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise InvalidRequestError(
                f"messages.{index}.name must be a string of 1 to {MAX_NAME_CHARS} characters",
                f"messages.{index}.name",
            )
        checked["name"] = check_text(name, f"messages.{index}.name")
    return {**checked, **tool_fields(index, message)} if tools else checked


def _text_part(part: Any, param: str) -> str:
    if isinstance(part, Mapping) and part.get("type") == "text":
        text = part.get("text")
        if isinstance(text, str):
            return text
    raise InvalidRequestError(f'{param} must be {{"type": "text", "text": "..."}}', param)


def prompt_token_ids(ids: Sequence[Any], param: str = "prompt") -> list[int]:
    """Token ids as sent (their range is checked against the vocabulary by the router)."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", param)
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise InvalidRequestError(f"{param} must be text or a list of token ids", param)
    return list(ids)


# --- structured outputs (issue 39): one constraint per request, from whichever field sent it ---

# Names of the grammar engine vLLM clients may ask for (`guided_decoding_backend`): ours.
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


def output_constraint(
    candidates: Sequence[tuple[str, str, Any]], whitespace_flexible: bool = False
) -> tuple[StructuredOutputs | None, str | None]:
    """The request's structured-outputs constraint and the field that sent it, from the
    `(field, kind, value)` candidates the wire layer found set (kind: a StructuredKind value;
    value: a JSON schema as a dict, bool or JSON text, a pattern, a grammar, a list of strings
    or, for json_object, True). More than one is refused, naming the second."""
    if not candidates:
        return None, None
    if len(candidates) > 1:
        first, second = candidates[0][0], candidates[1][0]
        raise InvalidRequestError(
            f"{second} and {first} are both set: a request takes one output constraint",
            second,
        )
    param, kind, value = candidates[0]
    try:
        return _constraint(kind, value, whitespace_flexible), param
    except ValueError as exc:
        reason = str(exc).removeprefix("structured_outputs ")
        raise InvalidRequestError(f"{param}: {reason}", param) from None


def _constraint(kind: str, value: Any, whitespace_flexible: bool) -> StructuredOutputs:
    if kind == StructuredKind.JSON:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError("must be a JSON schema (an object)")
        return StructuredOutputs.json_schema(value, whitespace_flexible=whitespace_flexible)
    if kind == StructuredKind.JSON_OBJECT:
        if value is not True:
            raise ValueError("json_object must be true when set")
        return StructuredOutputs(StructuredKind.JSON_OBJECT, "", whitespace_flexible)
    if kind == StructuredKind.CHOICE:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of strings")
        return StructuredOutputs.choice(value)
    if not isinstance(value, str):
        raise ValueError("must be text")
    return StructuredOutputs(StructuredKind(kind), value)


def check_grammar_backend(name: str, param: str) -> None:
    """vLLM's backend names that mean our grammar engine (llguidance) pass; others are 400."""
    backend, _, options = name.partition(":")
    if backend.strip().lower() not in GRAMMAR_BACKENDS:
        raise InvalidRequestError(
            f"{param} {name!r} is not available: this server's grammar engine is llguidance "
            f"(accepted names: {', '.join(GRAMMAR_BACKENDS)})",
            param,
        )
    if options.strip():  # vLLM's "backend:option,..." form: none of them is implemented here
        raise InvalidRequestError(
            f"{param} options ({options.strip()!r}) are not supported: send the backend name "
            "alone (whitespace: structured_outputs.disable_any_whitespace)",
            param,
        )
