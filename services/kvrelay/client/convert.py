"""Conversions between the SDK's Python values and the `kvrelay.v1` protobuf messages.

Checks what the wire format cannot carry (unknown keyword names, a negative value for an
unsigned field, wrong types); the ranges of the values themselves are the server's to judge,
so that the client and the server can never disagree about them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvrelay.client.errors import InvalidArgumentError
from kvrelay.client.types import (
    ChatMessage,
    Choice,
    ChoiceDelta,
    FinishReason,
    GenerateChunk,
    GenerateResult,
    Model,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvrelay.common.structured_outputs import StructuredOutputs
from kvrelay.v1 import generation_pb2 as pb

__all__ = [
    "SAMPLING_FIELDS",
    "ResultAssembler",
    "build_request",
    "chat_messages",
    "chunk_from_proto",
    "model_from_proto",
    "sampling_options",
]

# SamplingParams' names (vLLM's) that the wire carries, by kind. `check_sampling_names`
# rejects anything else, so a typo such as `max_token=` fails loudly instead of being ignored.
_UINT_FIELDS = ("n", "max_tokens", "min_tokens", "logprobs", "seed")
_INT_FIELDS = ("top_k",)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output")
_LIST_FIELDS = ("stop", "stop_token_ids", "allowed_token_ids")
_MAP_FIELDS = ("logit_bias",)
SAMPLING_FIELDS: frozenset[str] = frozenset(
    _UINT_FIELDS
    + _INT_FIELDS
    + _FLOAT_FIELDS
    + _BOOL_FIELDS
    + _LIST_FIELDS
    + _MAP_FIELDS
    + ("structured_outputs",)
)
# structured_outputs as a dict: one constraint (vLLM's names) and, optionally, any_whitespace.
_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

_FINISH_REASONS: dict[int, FinishReason | None] = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


def check_sampling_names(sampling: Mapping[str, object]) -> None:
    """Raise TypeError naming every keyword that is not a sampling parameter."""
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; sampling parameters are "
            f"{', '.join(sorted(SAMPLING_FIELDS))}"
        )


def _int(name: str, value: object, low: int, high: int) -> int:
    # bool is an int subclass; `n=True` is a caller's mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {value}")
    return float(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def sampling_options(sampling: Mapping[str, Any]) -> pb.SamplingOptions:
    """SamplingParams-named keywords -> `SamplingOptions`; a None value leaves a field unset.

    Raises:
        TypeError: a keyword is not a sampling parameter.
        InvalidArgumentError: a value cannot be carried (wrong type, negative unsigned, ...).
    """
    check_sampling_names(sampling)
    options = pb.SamplingOptions()
    for name, value in sampling.items():
        if value is None:
            continue
        if name in _UINT_FIELDS:
            high = _UINT64_MAX if name == "seed" else _UINT32_MAX
            setattr(options, name, _int(name, value, 0, high))
        elif name in _INT_FIELDS:
            setattr(options, name, _int(name, value, _INT32_MIN, _INT32_MAX))
        elif name in _FLOAT_FIELDS:
            setattr(options, name, _float(name, value))
        elif name in _BOOL_FIELDS:
            setattr(options, name, _bool(name, value))
        elif name == "stop":
            # OpenAI accepts one string or a list; a bare str must not split into characters.
            stops = [value] if isinstance(value, str) else list(_sequence(name, value))
            if not all(isinstance(s, str) for s in stops):
                raise InvalidArgumentError(f"stop must be strings, got {value!r}")
            options.stop.extend(stops)
        elif name == "structured_outputs":
            options.structured_outputs.CopyFrom(structured_outputs(value))
        elif name == "logit_bias":
            if not isinstance(value, Mapping):
                raise InvalidArgumentError(f"logit_bias must be a dict, got {value!r}")
            for token, bias in value.items():
                options.logit_bias[_int(name, token, 0, _UINT32_MAX)] = _float(name, bias)
        else:  # stop_token_ids, allowed_token_ids
            ids = [_int(name, i, 0, _UINT32_MAX) for i in _sequence(name, value)]
            if name == "allowed_token_ids" and not ids:  # the wire's empty list allows all
                raise InvalidArgumentError(f"{name} must name at least one token (None: any)")
            getattr(options, name).extend(ids)
    return options


def structured_outputs(value: object) -> pb.StructuredOutputs:
    """A `StructuredOutputs` (kvrelay.common.structured_outputs) or a dict holding one of
    json (a schema: dict or JSON text), json_object, regex, choice (a list of strings) or
    grammar, and optionally any_whitespace -> the `StructuredOutputs` message."""
    if isinstance(value, StructuredOutputs):
        spec: object = value.choices if value.kind == "choice" else value.spec
        fields = {value.kind.value: spec or True, "any_whitespace": value.whitespace_flexible}
    elif isinstance(value, Mapping):
        fields = dict(value)
    else:
        raise InvalidArgumentError(
            f"structured_outputs must be a StructuredOutputs or a dict, got {value!r}"
        )
    unknown = sorted(set(fields) - {*_CONSTRAINTS, "any_whitespace"})
    kinds = [k for k in _CONSTRAINTS if fields.get(k) is not None]
    if unknown or len(kinds) != 1:
        raise InvalidArgumentError(
            f"structured_outputs holds exactly one of {', '.join(_CONSTRAINTS)} "
            f"(and optionally any_whitespace), got {sorted(fields)}"
        )
    kind, spec = kinds[0], fields[kinds[0]]
    flexible = _bool("any_whitespace", fields.get("any_whitespace", False))
    message = pb.StructuredOutputs(any_whitespace=flexible)
    if kind == "choice":
        choices = list(_sequence("structured_outputs.choice", spec))
        if not all(isinstance(c, str) for c in choices):
            raise InvalidArgumentError(f"structured_outputs.choice must be strings, got {spec!r}")
        message.choice.values.extend(choices)
    elif kind == "json_object":
        message.json_object = _bool("structured_outputs.json_object", spec)
    elif kind == "json" and not isinstance(spec, str):
        message.json = json.dumps(spec, ensure_ascii=False)
    elif isinstance(spec, str):
        setattr(message, kind, spec)
    else:
        raise InvalidArgumentError(f"structured_outputs.{kind} must be text, got {spec!r}")
    return message


def _sequence(name: str, value: object) -> Iterable[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a list, got {type(value).__name__} {value!r}")
    return value


def chat_messages(messages: Sequence[Mapping[str, Any] | ChatMessage]) -> pb.ChatMessages:
    """OpenAI-style `{"role", "content"}` dicts or `ChatMessage`s -> `ChatMessages`."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of chat messages")
    out = pb.ChatMessages()
    for i, message in enumerate(messages):
        role: object
        content: object
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        else:
            raise InvalidArgumentError(
                f"messages[{i}] must be a dict or ChatMessage, got {type(message).__name__}"
            )
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidArgumentError(f"messages[{i}] needs string 'role' and 'content'")
        out.messages.add(role=role, content=content)
    return out


def build_request(
    *,
    prompt: str | Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any] | ChatMessage] | None = None,
    model: str | None,
    stream: bool,
    request_id: str | None,
    sampling: Mapping[str, Any],
    priority: int = 0,
) -> pb.GenerateRequest:
    """One `GenerateRequest` from exactly one of `prompt` (text or token ids) and `messages`.
    `priority`: vLLM's, lower first among this caller's waiting requests (an int32)."""
    options = sampling_options(sampling)  # first: a bad keyword is a TypeError, whatever else
    request = pb.GenerateRequest(
        request_id=request_id or "",
        model=model or "",
        sampling=options,
        stream=stream,
        priority=_int("priority", priority, -(2**31), 2**31 - 1),
    )
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt and messages")
    if messages is not None:
        request.messages.CopyFrom(chat_messages(messages))
    elif isinstance(prompt, str):
        request.prompt = prompt
    else:
        ids = [_int("prompt", t, 0, _UINT32_MAX) for t in _sequence("prompt", prompt)]
        request.prompt_token_ids.ids.extend(ids)
    return request


# --- responses -> types ---------------------------------------------------------------------


def _logprobs(items: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=lp.token,
            top_logprobs=tuple(
                TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
                for t in lp.top_logprobs
            ),
        )
        for lp in items
    )


def chunk_from_proto(response: pb.GenerateResponse) -> GenerateChunk:
    """One `GenerateResponse` -> `GenerateChunk` (usage only when the server set it)."""
    choices = tuple(
        ChoiceDelta(
            index=c.index,
            token_ids=tuple(c.token_ids),
            text=c.text,
            logprobs=_logprobs(c.logprobs),
            finish_reason=_FINISH_REASONS.get(c.finish_reason),
            stop_reason=c.stop_reason or None,
        )
        for c in response.choices
    )
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            cached_tokens=u.cached_tokens,
        )
    return GenerateChunk(request_id=response.request_id, choices=choices, usage=usage)


def model_from_proto(model: pb.Model) -> Model:
    return Model(
        id=model.id,
        max_model_len=model.max_model_len,
        created=model.created,
        owned_by=model.owned_by,
    )


class _SampleParts:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | None = None


class ResultAssembler:
    """Joins the chunks of one call into a `GenerateResult`.

    A whole (non-streamed) call normally gets one response, but nothing in the API forbids
    several, so deltas are concatenated per sample index either way.
    """

    def __init__(self) -> None:
        self._request_id = ""
        self._samples: dict[int, _SampleParts] = {}
        self._usage: Usage | None = None

    def add(self, chunk: GenerateChunk) -> None:
        self._request_id = chunk.request_id or self._request_id
        for delta in chunk.choices:
            parts = self._samples.setdefault(delta.index, _SampleParts())
            parts.text.append(delta.text)
            parts.token_ids.extend(delta.token_ids)
            parts.logprobs.extend(delta.logprobs)
            parts.finish_reason = delta.finish_reason or parts.finish_reason
            parts.stop_reason = delta.stop_reason or parts.stop_reason
        if chunk.usage is not None:
            self._usage = chunk.usage

    def result(self) -> GenerateResult:
        choices = tuple(
            Choice(
                index=index,
                text="".join(p.text),
                token_ids=tuple(p.token_ids),
                finish_reason=p.finish_reason,
                stop_reason=p.stop_reason,
                logprobs=tuple(p.logprobs),
            )
            for index, p in sorted(self._samples.items())
        )
        return GenerateResult(request_id=self._request_id, choices=choices, usage=self._usage)
