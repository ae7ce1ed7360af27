"""The one rule of structured-output fields for both APIs (router.prompts): which constraint
a request carries, the field named when it is wrong, and the backend names we answer to."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from kvrelay.router.prompts import GRAMMAR_BACKENDS, check_grammar_backend, output_constraint
from kvrelay.router.request_errors import InvalidRequestError


def test_no_candidate_is_no_constraint() -> None:
    assert output_constraint([]) == (None, None)


@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [
        ("json", {"type": "object"}, StructuredOutputs.json_schema({"type": "object"})),
        ("json", '{"type": "object"}', StructuredOutputs.json_schema({"type": "object"})),
        ("json_object", True, StructuredOutputs(StructuredKind.JSON_OBJECT)),
        ("choice", ["a", "b"], StructuredOutputs.choice(["a", "b"])),
        ("regex", "[0-9]+", StructuredOutputs(StructuredKind.REGEX, "[0-9]+")),
        ("grammar", 'start: "x"', StructuredOutputs(StructuredKind.GRAMMAR, 'start: "x"')),
    ],
)
def test_each_kind_becomes_its_constraint(kind: str, value: Any, expected: Any) -> None:
    constraint, param = output_constraint([("guided_x", kind, value)])
    assert constraint == expected and param == "guided_x"


def test_whitespace_reaches_json_kinds() -> None:
    constraint, _ = output_constraint([("f", "json", {"type": "object"})], whitespace_flexible=True)
    assert constraint is not None and constraint.whitespace_flexible


def test_two_constraints_name_the_second() -> None:
    candidates = [("response_format", "json", {}), ("guided_regex", "regex", "a")]
    with pytest.raises(InvalidRequestError, match="both set") as info:
        output_constraint(candidates)
    assert info.value.param == "guided_regex"


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("json", "{not json", "not valid JSON"),
        ("json", [1, 2], "must be a JSON schema"),
        ("json_object", False, "must be true"),
        ("choice", "yes", "list of strings"),
        ("choice", ["a", 1], "list of strings"),
        ("choice", [], "list of 1 to"),
        ("regex", "", "must not be empty"),
    ],
)
def test_bad_values_name_the_field_that_sent_them(kind: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        output_constraint([("structured_outputs.x", kind, value)])
    assert info.value.param == "structured_outputs.x"
    assert str(info.value).startswith("structured_outputs.x: ")


@pytest.mark.parametrize("name", [*GRAMMAR_BACKENDS, "Guidance", " llguidance "])
def test_our_engines_names_pass(name: str) -> None:
    check_grammar_backend(name, "guided_decoding_backend")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("xgrammar", "not available"),
        ("outlines", "not available"),
        ("guidance:disable-any-whitespace", "options"),
        ("auto:no-fallback", "options"),
    ],
)
def test_other_backends_and_options_are_refused(name: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        check_grammar_backend(name, "guided_decoding_backend")
    assert info.value.param == "guided_decoding_backend"
