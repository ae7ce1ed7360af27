"""Turning what a client sent into a prompt and sampling parameters, with errors that name the
field at fault (both APIs share these)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay.engine.sampling import SamplingParams
from kvrelay.router.errors import InvalidRequestError

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


def sampling_params(fields: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams from request fields; unset (None) ones keep vLLM's defaults."""
    kwargs = {k: v for k, v in fields.items() if v is not None}
    unknown = set(kwargs) - _SAMPLING_FIELDS
    if unknown:
        raise InvalidRequestError(f"unknown sampling fields: {', '.join(sorted(unknown))}")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        raise InvalidRequestError(message, field if field in _SAMPLING_FIELDS else None) from exc


def encode_prompt(tokenizer: Any, text: str, param: str = "prompt") -> list[int]:
    if not text:
        raise InvalidRequestError("the prompt is empty", param)
    return list(tokenizer(text)["input_ids"])


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> tuple[str, list[int]]:
    """The chat template applied to `messages`: (text, token ids)."""
    if not messages:
        raise InvalidRequestError("messages is empty: send at least one message", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template: use /v1/completions with plain text", "messages"
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # a template's own raise_exception, e.g. roles out of order
        message = f"the chat template rejected the messages: {exc}"
        raise InvalidRequestError(message, "messages") from exc
    # The template already holds every special token it wants.
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
