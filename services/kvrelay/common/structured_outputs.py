"""StructuredOutputs: the constraint a request puts on its output text (vLLM's structured
outputs): a JSON schema, any JSON object, a regular expression, one of a list of strings, or a
grammar. Plain data, validated on construction (ValueError naming the field); the grammar
engine that enforces it lives in kvrelay.common.grammar (compiling) and the engine (masking).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# A bound on what one request may ask the grammar compiler to read (a schema, a regex, a
# grammar): compiling is linear-ish in it, and it travels with every sample of the request.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 4096


class StructuredKind(StrEnum):
    JSON = "json"  # spec: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
    REGEX = "regex"  # spec: the pattern (Rust regex syntax, anchored at both ends)
    CHOICE = "choice"  # spec: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # spec: a Lark or GBNF grammar


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match; `whitespace_flexible` lets JSON kinds put any whitespace
    between tokens (vLLM's default is flexible; ours is compact, since a small model given
    free whitespace can spend its whole budget on newlines: vLLM's `disable_any_whitespace`)."""

    kind: StructuredKind
    spec: str = ""
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        try:
            kind = StructuredKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in StructuredKind)
            raise ValueError(f"structured_outputs kind must be one of {kinds}") from None
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.spec, str):
            raise ValueError("structured_outputs spec must be text")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs is longer than {MAX_SPEC_CHARS} characters")
        if not isinstance(self.whitespace_flexible, bool):
            raise ValueError("structured_outputs whitespace_flexible must be a bool")
        _CHECKS[kind](self.spec)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool, **options: Any) -> StructuredOutputs:
        """A JSON-schema constraint, stored as compact JSON text (keys in the client's order:
        the order of `properties` is the order the output's fields are written in)."""
        return cls(StructuredKind.JSON, canonical_json(schema), **options)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutputs:
        return cls(StructuredKind.CHOICE, json.dumps(list(options), ensure_ascii=False))

    @property
    def choices(self) -> list[str]:
        """The allowed strings of a CHOICE constraint."""
        values: list[str] = json.loads(self.spec)
        return values

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """Equal keys compile to the same grammar."""
        return (self.kind.value, self.spec, self.whitespace_flexible)


def canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs json is not JSON: {exc}") from None


def _check_json(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"structured_outputs json is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs json must be a JSON schema (an object)")


def _check_empty(spec: str) -> None:
    if spec:
        raise ValueError("structured_outputs json_object takes no spec")


def _check_text(spec: str) -> None:
    if not spec:
        raise ValueError("structured_outputs regex and grammar must not be empty")


def _check_choice(spec: str) -> None:
    try:
        values = json.loads(spec)
    except ValueError:
        values = None
    if not isinstance(values, list) or not values or len(values) > MAX_CHOICES:
        raise ValueError(f"structured_outputs choice must be a list of 1 to {MAX_CHOICES} strings")
    if not all(isinstance(v, str) and v for v in values):
        raise ValueError("structured_outputs choice must hold non-empty strings")


_CHECKS = {
    StructuredKind.JSON: _check_json,
    StructuredKind.JSON_OBJECT: _check_empty,
    StructuredKind.REGEX: _check_text,
    StructuredKind.CHOICE: _check_choice,
    StructuredKind.GRAMMAR: _check_text,
}
