"""The parsers of grammar-constrained tool calls, and the choice of parser for a request.

A named function's reply is its arguments object (router.tool_requests constrains it to the
function's parameters); a `required` reply is a JSON array of `{"name": ..., "arguments":
{...}}` calls, name first. Both stream: a call's id and name as soon as they are known, then
its arguments as the model writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from kvrelay.api.tool_calls import (
    HermesToolParser,
    ParsedDelta,
    ToolCallDelta,
    ToolCallParser,
    new_call_id,
)
from kvrelay.router.tool_requests import ToolChoice, ToolPlan


class NamedCallParser(ToolCallParser):
    """A named function's call: the whole reply is its arguments. A whole reply that is not
    JSON (cut short) is content; streamed, its fragments have gone out as arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self.called:
            return ParsedDelta(calls=[ToolCallDelta(0, text)])
        self.calls_shown = 1
        return ParsedDelta(calls=[ToolCallDelta(0, text, self.name, new_call_id())])

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Arguments that do not read as JSON (cut short by max_tokens) are content."""
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return super().whole(text)


# The parts of `[{"name":"f","arguments":{...}},...]` between arguments objects (the grammar
# writes compact JSON; whitespace is allowed anyway).
_OPEN = re.compile(r"\s*\[")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"arguments"\s*:\s*')
_ITEM_END = re.compile(r"\s*\}")
_NEXT = re.compile(r"\s*([,\]])")
_PATTERNS = {"open": _OPEN, "head": _HEAD, "item_end": _ITEM_END, "next": _NEXT}


class CallsArrayParser(ToolCallParser):
    """`required`: a JSON array of calls. A reply that does not read as one to its end (cut
    short by max_tokens) is content when whole; streamed, what is left unread ends as content."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._pos = 0  # what is read of _text
        self._state = "open"  # open, head, arguments, item_end, next, done, stuck
        self._depth = 0  # inside the arguments: open brackets
        self._in_string = False
        self._escaped = False

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        rest, self._pos = self._text[self._pos :], len(self._text)
        if self._state != "done":
            self._state = "stuck"
        return ParsedDelta(content=rest if rest.strip() else "")

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        content, calls = super().whole(text)
        return (content, calls) if self.done else (text, [])

    def _step(self, out: ParsedDelta) -> bool:
        """Read on from _pos; False when waiting for more text (or at the end)."""
        if self._state == "arguments":
            return self._arguments(out)
        pattern = _PATTERNS.get(self._state)
        match = pattern.match(self._text, self._pos) if pattern else None
        if match is None:
            return False
        self._pos = match.end()
        if self._state == "head":
            out.calls.append(ToolCallDelta(self.calls_shown, "", match.group(1), new_call_id()))
            self.calls_shown += 1
            self._state, self._depth = "arguments", 0
        elif self._state == "next":
            self._state = "head" if match.group(1) == "," else "done"
        else:
            self._state = {"open": "head", "item_end": "next"}[self._state]
        return True

    def _arguments(self, out: ParsedDelta) -> bool:
        """Show the arguments object read so far; True once it closes."""
        start, text = self._pos, self._text
        if self._depth == 0:  # before the object's "{"
            while start < len(text) and text[start].isspace():
                start += 1
            if start == len(text):
                self._pos = start
                return False
            if text[start] != "{":
                self._pos, self._state = start, "stuck"
                return False
        end = self._scan(start)
        if end > start:
            out.calls.append(ToolCallDelta(self.calls_shown - 1, text[start:end]))
        self._pos = end
        if self._depth == 0:
            self._state = "item_end"
            return True
        return False

    def _scan(self, pos: int) -> int:
        """Where the arguments object ends (just past its "}"), or the end of the text."""
        text = self._text
        while pos < len(text):
            char = text[pos]
            pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return pos
        return pos


def tool_call_parsers(plan: ToolPlan) -> Callable[[], ToolCallParser] | None:
    """A maker of one parser per choice for the request's plan (None: replies are text)."""
    if not plan.parses_calls:
        return None
    if plan.choice is ToolChoice.NAMED:
        named = plan.named
        assert named is not None
        return lambda: NamedCallParser(named)
    if plan.choice is ToolChoice.REQUIRED:
        return CallsArrayParser
    names = [f.name for f in plan.functions]
    return lambda: HermesToolParser(names, plan.max_calls)
