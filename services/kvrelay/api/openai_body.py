"""The base of every OpenAI request body model: no field is silently ignored.

A body may hold fields its model does not declare (pydantic keeps them as extras) so that the
refusal is ours, in OpenAI's error shape with `param` naming the field as sent, nested ones in
dotted form (`stream_options.include_obfuscation`, `messages.0.name`). A field is implemented
by declaring it in its model; a few undeclared ones are accepted at the values that mean what
kvrelay does anyway (`accepted_values`: `store: false`, `use_beam_search: false`). An explicit
JSON null means the field's default, as OpenAI and vLLM read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from kvrelay.router.request_errors import InvalidRequestError

# Why some fields are refused, where the reason helps the client more than "not supported".
REFUSAL_REASONS = {
    "guided_whitespace_pattern": "JSON is written compact, or with any whitespace when "
    "structured_outputs.disable_any_whitespace is false",
    "whitespace_pattern": "JSON is written compact, or with any whitespace when "
    "disable_any_whitespace is false",
    "structural_tag": "structural tags are not implemented; use a JSON schema or a grammar",
    "chat_template": "the model's own chat template is always used",
    "cache_salt": "the prefix cache is not salted per request on this server",
}


# Per field: the values at which an undeclared field is accepted.
Accepted = dict[str, tuple[Any, ...]]


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    # Undeclared fields accepted at these values only (they change nothing here).
    accepted_values: ClassVar[Accepted] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def refuse_unknown(self, path: str = "") -> None:
        """Raise InvalidRequestError naming the first field, at any depth, that this server
        does not implement (undeclared, and not at an accepted value)."""
        for name, value in (self.model_extra or {}).items():
            if not any(_same(value, ok) for ok in self.accepted_values.get(name, ())):
                raise _refusal(f"{path}{name}", name, self.accepted_values.get(name, ()))
        for name, field in type(self).model_fields.items():
            wire = field.alias or name
            for suffix, item in _nested(getattr(self, name)):
                item.refuse_unknown(f"{path}{wire}{suffix}.")


def _nested(value: Any) -> Iterator[tuple[str, RequestBody]]:
    if isinstance(value, RequestBody):
        yield "", value
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, RequestBody):
                yield f".{index}", item


def _same(value: Any, accepted: Any) -> bool:
    """Equal, and a bool only equals a bool (`priority: false` is not `priority: 0`)."""
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def _refusal(param: str, name: str, accepted: tuple[Any, ...]) -> InvalidRequestError:
    message = f"{param} is not supported by this server"
    if accepted:
        values = " or ".join(repr(v) for v in accepted)
        message = f"{param} is only accepted as {values} here (it is not implemented)"
    reason = REFUSAL_REASONS.get(name)
    if reason:
        message = f"{message}: {reason}"
    return InvalidRequestError(f"{message} (docs/api.md lists every field)", param)
