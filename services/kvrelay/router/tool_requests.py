"""Tool calling, the request side: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
checked field by field (an InvalidRequestError naming e.g. `tools.1.function.name`), and the
constraint that forces a call (`required`, a named function) as a JSON schema for
StructuredOutputs. The older `functions` / `function_call` are refused, naming them.

A request rule, not a wire one: the HTTP API reads these fields; the gRPC API has none, so a
gRPC client cannot reach tools (its chat messages refuse the `tool` role).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvrelay.common.grammar import GrammarError, check_grammar, llguidance_available
from kvrelay.common.structured_outputs import StructuredOutputs
from kvrelay.router.request_errors import InvalidRequestError

# OpenAI's rule for a function's name.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's bound on one request's tools
# What a function without `parameters` takes: no arguments.
EMPTY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


class ToolChoice(StrEnum):
    NONE = "none"  # tools shown to the model (as vLLM does), no call parsed
    AUTO = "auto"  # the model decides; its own tool-call format is parsed
    REQUIRED = "required"  # at least one call, constrained to the tools' schemas
    NAMED = "function"  # one call of the named function, constrained to its parameters


@dataclass(frozen=True)
class ToolFunction:
    name: str
    parameters: Mapping[str, Any]
    description: str | None = None
    strict: bool | None = None

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI spells it, for a chat template's `tools`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask for, checked."""

    functions: tuple[ToolFunction, ...]
    choice: ToolChoice
    named: str | None = None  # the function of ToolChoice.NAMED
    parallel: bool = True  # parallel_tool_calls: more than one call per reply

    @property
    def parses_calls(self) -> bool:
        return bool(self.functions) and self.choice is not ToolChoice.NONE

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def function(self, name: str) -> ToolFunction:
        return next(f for f in self.functions if f.name == name)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [f.openai() for f in self.functions] or None

    def structured_outputs(self) -> StructuredOutputs | None:
        """The constraint on the output: a named function's arguments object, or for
        `required` an array of {"name", "arguments"} calls (one unless parallel)."""
        if self.choice is ToolChoice.NAMED:
            assert self.named is not None
            return StructuredOutputs.json_schema(self.function(self.named).parameters)
        if self.choice is ToolChoice.REQUIRED:
            return StructuredOutputs.json_schema(calls_schema(self.functions, self.parallel))
        return None

    def constrain(self, fields: dict[str, Any], field_names: dict[str, str]) -> None:
        """Put the forced call's constraint into a request's sampling `fields` (and name
        tool_choice as its field); a request constrained otherwise too is refused."""
        constraint = self.structured_outputs()
        if constraint is None:
            return
        if fields.get("structured_outputs") is not None:
            other = field_names.get("structured_outputs", "structured_outputs")
            raise InvalidRequestError(
                f"tool_choice {self.choice.value!r} constrains the output to a tool call; "
                f"it cannot be combined with {other}",
                "tool_choice",
            )
        fields["structured_outputs"] = constraint
        field_names["structured_outputs"] = "tool_choice"


def calls_schema(functions: tuple[ToolFunction, ...], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `required`'s output: `[{"name": ..., "arguments": {...}}, ...]`,
    name first (the order the grammar writes them in, so a stream names the call first)."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": dict(f.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(
    tools: Any,
    tool_choice: Any = None,
    parallel_tool_calls: Any = None,
    functions: Any = None,
    function_call: Any = None,
) -> ToolPlan:
    """The checked plan of a request's tool fields (None: the field was not sent)."""
    legacy = {"functions": (functions, "tools"), "function_call": (function_call, "tool_choice")}
    for field, (value, replacement) in legacy.items():
        if value is not None:
            message = f"{field} is OpenAI's deprecated form, not supported here: send {replacement}"
            raise InvalidRequestError(message, field)
    parsed = _functions(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a bool", "parallel_tool_calls")
    choice, named = _choice(tool_choice, parsed)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    plan = ToolPlan(parsed, choice, named, parallel)
    constraint = plan.structured_outputs()
    if constraint is not None:
        _check_compiles(constraint, "tool_choice")
    return plan


def _functions(tools: Any) -> tuple[ToolFunction, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    parsed: list[ToolFunction] = []
    for i, tool in enumerate(tools):
        function = _function(tool, f"tools.{i}")
        if any(f.name == function.name for f in parsed):
            raise InvalidRequestError(
                f"tools names the function {function.name!r} twice", f"tools.{i}.function.name"
            )
        parsed.append(function)
    return tuple(parsed)


def _function(tool: Any, param: str) -> ToolFunction:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError(f"{param} must be an object", param)
    unknown = set(tool) - {"type", "function"}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequestError(f"{param}.{name} is not a field of a tool", f"{param}.{name}")
    if tool.get("type") != "function":
        message = f'{param}.type must be "function", got {tool.get("type")!r}'
        raise InvalidRequestError(message, f"{param}.type")
    function = tool.get("function")
    param = f"{param}.function"
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"{param} must be an object", param)
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequestError(f"{param}.{name} is not a field of a function", f"{param}.{name}")
    return ToolFunction(
        _name(function.get("name"), f"{param}.name"),
        _parameters(function.get("parameters"), f"{param}.parameters"),
        _optional(function, "description", str, param),
        _optional(function, "strict", bool, param),
    )


def _name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{param} must be 1 to 64 letters, digits, underscores or dashes, got {name!r}"[:200],
            param,
        )
    return name


def _optional(function: Mapping[str, Any], field: str, kind: type, param: str) -> Any:
    """`field` of `function` if sent (None otherwise), of type `kind` (str or bool)."""
    value = function.get(field)
    if value is not None and type(value) is not kind:
        raise InvalidRequestError(f"{param}.{field} must be a {kind.__name__}", f"{param}.{field}")
    return value


def _parameters(parameters: Any, param: str) -> Mapping[str, Any]:
    """A function's parameters: a JSON schema of an object (absent: no arguments)."""
    if parameters is None:
        return EMPTY_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object)", param)
    kind = parameters.get("type", "object")
    if kind != "object":
        message = f'{param} must describe an object (type "object"), got type {kind!r}'
        raise InvalidRequestError(message[:200], param)
    try:
        constraint = StructuredOutputs.json_schema(parameters)
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param) from None
    _check_compiles(constraint, param)
    return parameters


def _check_compiles(constraint: StructuredOutputs, param: str) -> None:
    if not llguidance_available():  # the engine cannot enforce it either: refused there
        return
    try:
        check_grammar(constraint)
    except GrammarError as exc:
        message = str(exc).splitlines()[0] if str(exc) else "it does not compile"
        raise InvalidRequestError(
            f"{param} is not a usable JSON schema: {message}", param
        ) from None


def _choice(choice: Any, functions: tuple[ToolFunction, ...]) -> tuple[ToolChoice, str | None]:
    if choice is None:
        return (ToolChoice.AUTO if functions else ToolChoice.NONE), None
    if isinstance(choice, str):
        try:
            parsed = ToolChoice(choice)
        except ValueError:
            parsed = ToolChoice.NAMED  # refused below: "function" is no string choice
        if parsed is ToolChoice.NAMED:
            message = 'tool_choice must be "none", "auto", "required" or a named function'
            raise InvalidRequestError(message, "tool_choice")
        if parsed is ToolChoice.REQUIRED and not functions:
            raise InvalidRequestError('tool_choice "required" needs tools', "tool_choice")
        return parsed, None
    name = _named(choice)
    if not any(f.name == name for f in functions):
        names = ", ".join(f.name for f in functions) or "none"
        message = f"tool_choice names the function {name!r}, which is not in tools ({names})"
        raise InvalidRequestError(message[:300], "tool_choice.function.name")
    return ToolChoice.NAMED, name


def _named(choice: Any) -> str:
    """The name in {"type": "function", "function": {"name": ...}}."""
    shape = '{"type": "function", "function": {"name": ...}}'
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        message = f'tool_choice must be "none", "auto", "required" or {shape}'
        raise InvalidRequestError(message, "tool_choice")
    function = choice.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"tool_choice must be {shape}", "tool_choice.function")
    return _name(function.get("name"), "tool_choice.function.name")
