"""StructuredOutputs (common): what a constraint may hold, and llguidance's compile check."""

from __future__ import annotations

import pytest

from kvrelay.common.grammar import GrammarError, check_grammar, grammar_text
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.structured_outputs import MAX_SPEC_CHARS, StructuredKind, StructuredOutputs


def test_json_schema_keeps_the_clients_property_order() -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {}}}
    spec = StructuredOutputs.json_schema(schema).spec
    assert spec.index("zeta") < spec.index("alpha")
    assert " " not in spec  # compact: equal schemas give equal cache keys


def test_equal_constraints_share_a_cache_key() -> None:
    a = StructuredOutputs.json_schema({"type": "object"})
    b = StructuredOutputs(StructuredKind.JSON, '{"type":"object"}')
    assert a == b and a.cache_key == b.cache_key and hash(a) == hash(b)
    assert (
        a.cache_key
        != StructuredOutputs.json_schema({"type": "object"}, whitespace_flexible=True).cache_key
    )


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("yaml", "", "kind must be one of"),
        ("json", "{", "not valid JSON"),
        ("json", "[1]", "must be a JSON schema"),
        ("json_object", "{}", "takes no spec"),
        ("regex", "", "must not be empty"),
        ("grammar", "", "must not be empty"),
        ("choice", "[]", "list of 1 to"),
        ("choice", '["a", ""]', "non-empty strings"),
        ("choice", '["a", 1]', "non-empty strings"),
        ("regex", "a" * (MAX_SPEC_CHARS + 1), "longer than"),
    ],
)
def test_malformed_constraints_are_refused(kind: str, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="structured_outputs") as info:
        StructuredOutputs(kind, spec)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_sampling_params_carries_a_constraint() -> None:
    constraint = StructuredOutputs.choice(["yes", "no"])
    params = SamplingParams(structured_outputs=constraint)
    assert params.structured_outputs is constraint
    assert constraint.choices == ["yes", "no"]
    assert SamplingParams().structured_outputs is None


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputs(StructuredKind.JSON_OBJECT),
        StructuredOutputs(StructuredKind.REGEX, r"[0-9]{3}-[a-z]+"),
        StructuredOutputs.choice(["red", "green"]),
        StructuredOutputs(StructuredKind.GRAMMAR, 'root ::= "yes" | "no"'),
        StructuredOutputs(StructuredKind.GRAMMAR, 'start: "a"+'),
    ],
)
def test_valid_constraints_compile(constraint: StructuredOutputs) -> None:
    check_grammar(constraint)
    assert grammar_text(constraint)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputs(StructuredKind.REGEX, "a(b"), "unclosed group"),
        (StructuredOutputs.json_schema({"type": "foo"}), "foo"),
        (StructuredOutputs(StructuredKind.GRAMMAR, "root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_constraints_that_do_not_compile_say_why(
    constraint: StructuredOutputs, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        check_grammar(constraint)
