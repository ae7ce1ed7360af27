"""Tool calls read out of a chat reply, whole and streamed, in OpenAI's shapes.

One parser per choice takes the reply's text as it arrives (`feed`) and at its end (`finish`),
and returns what the client may be shown so far: content text and tool-call deltas (a call's
id, type and name first, then fragments of its arguments). A whole reply is the same parser fed
once, so the two always agree.

`auto` replies are read in the Hermes format (the Qwen family's, and what the tool instruction
of router.tool_messages asks for): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
Text that may be the start of a tag is held back until it is known; a call is shown once its
tag closes and its JSON reads as a call of one of the request's tools. Anything else, a
malformed call included, is content: no text is lost. Whitespace next to a call is dropped.
`required` and named choices are grammar-constrained (kvrelay.api.tool_call_parsers).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvrelay.router.tool_messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallDelta:
    """News of one call: its first delta has id and name, later ones argument fragments."""

    index: int  # the call's position among its choice's calls
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class ParsedDelta:
    """What a piece of reply text showed: content, and tool-call deltas after it."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, later: ParsedDelta) -> None:
        self.content += later.content
        self.calls.extend(later.calls)

    def openai_calls(self) -> list[dict[str, Any]]:
        """The calls' deltas in OpenAI's shape, one entry per call (fragments joined)."""
        joined: list[ToolCallDelta] = []
        for delta in self.calls:
            if joined and joined[-1].index == delta.index:
                joined[-1].arguments += delta.arguments
            else:
                joined.append(ToolCallDelta(delta.index, delta.arguments, delta.name, delta.id))
        return [delta.openai() for delta in joined]


class ToolCallParser:
    """The base of the parsers: `feed` text, then `finish` once; `called` once a call shown."""

    def __init__(self) -> None:
        self.calls_shown = 0

    @property
    def called(self) -> bool:
        return self.calls_shown > 0

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole reply: (content, None when there is none beside calls; OpenAI's calls)."""
        parsed = self.feed(text)
        parsed.extend(self.finish())
        return (parsed.content or None) if parsed.calls else parsed.content, merge_calls(
            parsed.calls
        )


def merge_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Whole calls in OpenAI's message shape from their deltas."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = {
                "id": delta.id,
                "type": "function",
                "function": {"name": delta.name, "arguments": ""},
            }
        calls[delta.index]["function"]["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]


class HermesToolParser(ToolCallParser):
    """`auto`: `<tool_call>` JSON blocks in free text, calls of the functions in `names`; at
    most `max_calls` of them (parallel_tool_calls false: 1; later blocks stay content)."""

    def __init__(self, names: Collection[str], max_calls: int | None = None) -> None:
        super().__init__()
        self.names = frozenset(names)
        self.max_calls = max_calls
        self._buffer = ""  # text not yet shown or decided
        self._in_call = False  # the buffer is inside an open <tool_call>
        self._held_space = ""  # whitespace that is dropped if a call follows it
        self._after_call = False  # leading whitespace after a call is dropped

    @property
    def _may_call(self) -> bool:
        return self.max_calls is None or self.calls_shown < self.max_calls

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        while True:
            if self._in_call:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE) :]
                self._in_call = False
                self._block(body, True, out)
                continue
            start = self._buffer.find(TOOL_CALL_OPEN) if self._may_call else -1
            if start < 0:
                keep = _partial_tag(self._buffer) if self._may_call else 0
                cut = len(self._buffer) - keep
                self._content(self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return out
            self._content(self._buffer[:start], out)
            self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
            self._in_call = True

    def finish(self) -> ParsedDelta:
        """The end of the reply: an unclosed last call is read as one if its JSON is whole;
        held text is shown."""
        out = ParsedDelta()
        if self._in_call:
            self._in_call = False
            self._block(self._buffer, False, out)
        else:
            self._content(self._buffer, out)
        out.content += self._held_space
        self._buffer = self._held_space = ""
        return out

    def _content(self, text: str, out: ParsedDelta) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._held_space + text
        shown = text.rstrip()
        self._held_space = text[len(shown) :]
        out.content += shown

    def _block(self, body: str, closed: bool, out: ParsedDelta) -> None:
        call = self._call(body)
        if call is None:  # not a call: its text is content, as written
            raw = TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")
            out.content += self._held_space + raw
            self._held_space, self._after_call = "", False
            return
        name, arguments = call
        out.calls.append(ToolCallDelta(self.calls_shown, arguments, name, new_call_id()))
        self.calls_shown += 1
        self._held_space, self._after_call = "", True

    def _call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) if `body` is a call of a known function."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict) or set(call) - {"name", "arguments", "parameters"}:
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that is a start of `<tool_call>`."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
