"""The structured-output fields of both OpenAI endpoints, as sent: OpenAI's `response_format`,
vLLM's `structured_outputs` object and its older `guided_*` fields. They only say which field
holds which kind of constraint; kvrelay.router.prompts.output_constraint turns that into the
request's StructuredOutputs (one per request) with the rules the gRPC API shares.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, PrivateAttr

from kvrelay.api.openai_body import Accepted, RequestBody
from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
from kvrelay.router.prompts import check_grammar_backend, output_constraint
from kvrelay.router.request_errors import InvalidRequestError

Candidate = tuple[str, str, Any]  # (the field as sent, a StructuredKind value, its value)

# The older vLLM fields and the kind each one asks for.
_GUIDED = (
    ("guided_json", StructuredKind.JSON),
    ("guided_regex", StructuredKind.REGEX),
    ("guided_choice", StructuredKind.CHOICE),
    ("guided_grammar", StructuredKind.GRAMMAR),
    ("guided_json_object", StructuredKind.JSON_OBJECT),
)


class JsonSchemaFormat(RequestBody):
    """OpenAI's `response_format.json_schema`. `name` and `description` label the schema for
    the client; the output is held to `schema` whatever `strict` says (grammar-enforced)."""

    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(RequestBody):
    type: str
    json_schema: JsonSchemaFormat | None = None

    def candidates(self) -> list[Candidate]:
        if self.type != "json_schema" and self.json_schema is not None:
            param = "response_format.json_schema"
            message = f'{param} is only read with type "json_schema", got {self.type!r}'
            raise InvalidRequestError(message, param)
        if self.type == "text":
            return []
        if self.type == "json_object":
            return [("response_format", StructuredKind.JSON_OBJECT, True)]
        if self.type == "json_schema":
            spec = self.json_schema
            if spec is None or spec.schema_ is None:
                param = "response_format.json_schema" + ("" if spec is None else ".schema")
                raise InvalidRequestError(f"{param} is required with type json_schema", param)
            return [("response_format.json_schema.schema", StructuredKind.JSON, spec.schema_)]
        raise InvalidRequestError(
            f"response_format.type must be text, json_object or json_schema, got {self.type!r}",
            "response_format.type",
        )


class StructuredOutputsParams(RequestBody):
    """vLLM's `structured_outputs` object. `disable_any_whitespace` unset keeps kvrelay's
    compact JSON; false lets JSON kinds put any whitespace between tokens (vLLM's default)."""

    accepted_values: ClassVar[Accepted] = {
        "disable_additional_properties": (False,),
    }
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def candidates(self) -> list[Candidate]:
        found: list[Candidate] = []
        for name, kind in (
            ("json_", StructuredKind.JSON),
            ("regex", StructuredKind.REGEX),
            ("choice", StructuredKind.CHOICE),
            ("grammar", StructuredKind.GRAMMAR),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((f"structured_outputs.{name.rstrip('_')}", kind, value))
        if self.json_object:  # false asks for nothing
            found.append(("structured_outputs.json_object", StructuredKind.JSON_OBJECT, True))
        return found


class StructuredFields(RequestBody):
    """The structured-output fields both endpoints take; `check_constraint` reads them once."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_decoding_backend: str | None = None
    _constraint: tuple[StructuredOutputs | None, str | None] = PrivateAttr((None, None))

    def check_constraint(self) -> None:
        """Read the request's constraint (InvalidRequestError naming the field at fault)."""
        if self.guided_decoding_backend is not None:
            check_grammar_backend(self.guided_decoding_backend, "guided_decoding_backend")
        found: list[Candidate] = []
        if self.response_format is not None:
            found += self.response_format.candidates()
        options = self.structured_outputs
        if options is not None:
            found += options.candidates()
        for name, kind in _GUIDED:
            value = getattr(self, name)
            if value is not None and value is not False:
                found.append((name, kind, value))
        flexible = options is not None and options.disable_any_whitespace is False
        self._constraint = output_constraint(found, flexible)

    @property
    def output_constraint(self) -> StructuredOutputs | None:
        return self._constraint[0]

    @property
    def constraint_names(self) -> dict[str, str]:
        """{"structured_outputs": the field that sent it}, for errors found later."""
        param = self._constraint[1]
        return {} if param is None else {"structured_outputs": param}
