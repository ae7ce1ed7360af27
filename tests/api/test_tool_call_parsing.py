"""The tool-call parsers (kvrelay.api.tool_calls, kvrelay.api.tool_call_parsers): whole replies,
and the same replies streamed in every split, which must show the same content and calls; and
the formatter's OpenAI shapes for them."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.api.openai_format import OpenAIFormatter
from kvrelay.api.tool_call_parsers import CallsArrayParser, NamedCallParser, tool_call_parsers
from kvrelay.api.tool_calls import HermesToolParser, ParsedDelta, ToolCallParser
from kvrelay.router.tool_requests import tool_plan
from kvrelay.router.types import ChoiceDelta, GenerateChunk

NAMES = ("get_weather", "add")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}</tool_call>'


def hermes(max_calls: int | None = None) -> HermesToolParser:
    return HermesToolParser(NAMES, max_calls)


def streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) as a client sees them when `pieces` arrive one by one; checks the
    deltas' shape on the way: a call's first delta has id, type and name, later ones not."""
    total = ParsedDelta()
    seen: set[int] = set()
    for piece in pieces:
        parsed = parser.feed(piece)
        total.extend(parsed)
        _check_shape(parsed, seen)
    last = parser.finish()
    _check_shape(last, seen)
    total.extend(last)
    calls: dict[int, dict[str, Any]] = {}
    for delta in total.calls:
        call = calls.setdefault(delta.index, {"name": delta.name, "arguments": ""})
        call["arguments"] += delta.arguments
    return total.content, [calls[i] for i in sorted(calls)]


def _check_shape(parsed: ParsedDelta, seen: set[int]) -> None:
    for entry in parsed.openai_calls():
        first = entry["index"] not in seen
        assert ("id" in entry) == first, entry
        if first:
            assert entry["id"].startswith("call_") and entry["type"] == "function"
            assert entry["function"]["name"] in (*NAMES, "f", "g")
            seen.add(entry["index"])


def whole(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    content, calls = parser.whole(text)
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return content, [{k: c["function"][k] for k in ("name", "arguments")} for c in calls]


def every_split(text: str) -> list[list[str]]:
    """Every cut into two pieces, every pair of cuts around each tag, and one per character."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for i in range(0, len(text), 3):
        splits += [[text[:i], text[i:j], text[j:]] for j in range(i, min(len(text), i + 14))]
    return [*splits, list(text)]


def assert_streams_like_whole(make: Callable[[], ToolCallParser], text: str) -> None:
    content, calls = whole(make(), text)
    for pieces in every_split(text):
        got_content, got_calls = streamed(make(), pieces)
        assert got_calls == calls, pieces
        assert got_content == (content or ""), pieces


# -- Hermes (auto) --------------------------------------------------------------------------------


def test_text_without_calls_is_content_unchanged() -> None:
    for text in ["", "Paris is sunny.\n", "a < b and <tool not a call", "  spaced  \n\n"]:
        assert whole(hermes(), text) == (text, [])
        assert_streams_like_whole(hermes, text)


def test_a_call_after_text() -> None:
    text = f"Let me look that up.\n{WEATHER}\n"
    content, calls = whole(hermes(), text)
    assert content == "Let me look that up."
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert_streams_like_whole(hermes, text)


def test_two_calls_and_no_content_is_null_content() -> None:
    text = f"{WEATHER}\n{ADD}"
    content, calls = whole(hermes(), text)
    assert content is None
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": [2, "}"]}
    assert_streams_like_whole(hermes, text)


def test_text_that_may_start_a_tag_is_held_back_until_known() -> None:
    parser = hermes()
    assert parser.feed("Sure <tool_").content == "Sure"
    assert parser.feed("box>").content == " <tool_box>"
    parser = hermes()
    assert parser.feed("Sure <tool_").content == "Sure"
    parsed = parser.feed('call>{"name": "add", "arguments": {}}</tool_call>')
    assert parsed.content == "" and parsed.calls[0].name == "add"
    assert parser.finish().content == ""


def test_a_malformed_call_is_content_never_lost() -> None:
    for bad in [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>',
        '<tool_call>["add"]</tool_call>',
    ]:
        text = f"Answer: {bad} done"
        assert whole(hermes(), text) == (text, [])
        assert_streams_like_whole(hermes, text)


def test_a_bad_call_beside_a_good_one_stays_as_written() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    text = f"{WEATHER} {bad}"
    content, calls = whole(hermes(), text)
    assert content == bad and len(calls) == 1
    assert_streams_like_whole(hermes, text)


def test_an_unclosed_last_call_counts_if_its_json_is_whole() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n'
    assert whole(hermes(), text) == (None, [{"name": "add", "arguments": '{"a": 2}'}])
    cut = '<tool_call>\n{"name": "add", "argum'
    assert whole(hermes(), cut) == (cut, [])
    assert_streams_like_whole(hermes, text)
    assert_streams_like_whole(hermes, cut)


def test_arguments_as_json_text_and_parameters_are_read() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert whole(hermes(), text)[1] == [{"name": "add", "arguments": '{"a": 1}'}]
    text = '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>'
    assert whole(hermes(), text)[1] == [{"name": "add", "arguments": '{"a": 1}'}]
    text = '<tool_call>{"name": "add"}</tool_call>'
    assert whole(hermes(), text)[1] == [{"name": "add", "arguments": "{}"}]


def test_without_parallel_calls_later_ones_stay_content() -> None:
    text = f"{WEATHER}\n{ADD}"
    content, calls = whole(hermes(max_calls=1), text)
    assert [c["name"] for c in calls] == ["get_weather"]
    assert content == ADD
    assert_streams_like_whole(lambda: hermes(max_calls=1), text)


# -- grammar-forced: required (an array of calls) and a named function ----------------------------

CALLS = '[{"name":"f","arguments":{"s":"a}\\"{","n":[1,{"x":null}]}},{"name":"g","arguments":{}}]'


def test_required_calls_whole_and_streamed() -> None:
    content, calls = whole(CallsArrayParser(), CALLS)
    assert content is None
    assert [c["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["arguments"]) == {"s": 'a}"{', "n": [1, {"x": None}]}
    assert calls[1]["arguments"] == "{}"
    assert_streams_like_whole(CallsArrayParser, CALLS)


def test_required_calls_with_whitespace() -> None:
    text = ' [ { "name" : "f" , "arguments" : { "a" : 1 } } ]'
    assert whole(CallsArrayParser(), text) == (None, [{"name": "f", "arguments": '{ "a" : 1 }'}])
    assert_streams_like_whole(CallsArrayParser, text)


def test_required_calls_stream_the_name_before_the_arguments_end() -> None:
    parser = CallsArrayParser()
    parsed = parser.feed('[{"name":"f","arguments":{"city":"Pa')
    (entry,) = parsed.openai_calls()
    assert entry["function"] == {"name": "f", "arguments": '{"city":"Pa'}
    (entry,) = parser.feed('ris"}}]').openai_calls()
    assert entry == {"index": 0, "function": {"arguments": 'ris"}'}}
    assert parser.done


def test_a_required_reply_cut_short_is_content_when_whole() -> None:
    for cut in (CALLS[:-1], CALLS[:30], "", "not json"):
        assert whole(CallsArrayParser(), cut) == (cut, [])


def test_named_call_is_the_whole_reply() -> None:
    text = '{"city": "Paris"}'
    assert whole(NamedCallParser("get_weather"), text) == (
        None,
        [{"name": "get_weather", "arguments": text}],
    )
    assert_streams_like_whole(lambda: NamedCallParser("get_weather"), text)
    assert whole(NamedCallParser("get_weather"), "") == ("", [])
    assert whole(NamedCallParser("get_weather"), '{"city": "Par') == ('{"city": "Par', [])


# -- the formatter: OpenAI's message and delta shapes ---------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES
]


async def _chunks(pieces: list[tuple[int, str, str | None]]) -> AsyncIterator[GenerateChunk]:
    for index, text, finish in pieces:
        yield GenerateChunk("r", [ChoiceDelta(index, [1], text, finish_reason=finish)])


def _formatter(choice: Any = None) -> OpenAIFormatter:
    parsers = tool_call_parsers(tool_plan(TOOLS, choice))
    return OpenAIFormatter("r", "m", True, None, tool_parsers=parsers)


REPLIES = [
    (0, "It is ", None),
    (1, WEATHER[:15], None),
    (0, "sunny.", "stop"),
    (1, WEATHER[15:], "stop"),
]


def test_whole_choices_are_parsed_each_on_its_own() -> None:
    body = asyncio.run(_formatter().whole(_chunks(REPLIES), 2, False))
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "It is sunny."}
    assert first["finish_reason"] == "stop"
    assert second["finish_reason"] == "tool_calls"
    assert second["message"]["content"] is None
    (call,) = second["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_streamed_choices_carry_openai_deltas() -> None:
    async def events() -> list[dict[str, Any]]:
        out = []
        async for event in _formatter().sse(_chunks(REPLIES), False, False):
            if event.strip() != "data: [DONE]":
                out.append(json.loads(event.removeprefix("data: ")))
        return out

    choices = [c for event in asyncio.run(events()) for c in event["choices"]]
    first = [c for c in choices if c["index"] == 0]
    second = [c for c in choices if c["index"] == 1]
    assert "".join(c["delta"].get("content", "") for c in first) == "It is sunny."
    assert first[0]["delta"]["role"] == "assistant" and first[-1]["finish_reason"] == "stop"
    assert second[0]["delta"] == {"role": "assistant", "content": ""}  # the tag held back
    (entry,) = second[-1]["delta"]["tool_calls"]
    assert entry["function"]["name"] == "get_weather" and entry["index"] == 0
    assert second[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice", ["none", None])
def test_tool_choice_none_or_no_tools_means_plain_text(choice: Any) -> None:
    plan = tool_plan(TOOLS if choice else None, choice)
    assert tool_call_parsers(plan) is None


# -- any mix of text, calls and bad blocks, cut anywhere -------------------------------------------

_fragments = ["a", " ", "\n", "<", ">", "<tool", "<tool_call", "</tool_call>", "{", "}", '"']
_words = st.lists(st.sampled_from(_fragments), max_size=6).map("".join)
_calls = st.builds(
    lambda name, value: (name, {"v": value}),
    st.sampled_from(NAMES),
    st.one_of(st.integers(), st.text(max_size=5), st.lists(st.booleans(), max_size=2)),
)
_bad = st.sampled_from(["<tool_call>{x}</tool_call>", '<tool_call>{"name": "zz"}</tool_call>'])
_segments = st.lists(
    st.one_of(st.tuples(st.just("text"), _words), st.tuples(st.just("call"), _calls),
              st.tuples(st.just("bad"), _bad)),
    max_size=5,
)  # fmt: skip


def cut(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _render(segments: list[tuple[str, Any]]) -> str:
    parts = []
    for kind, value in segments:
        if kind == "call":
            name, arguments = value
            call = json.dumps({"name": name, "arguments": arguments})
            parts.append(f"<tool_call>\n{call}\n</tool_call>")
        else:
            parts.append(value)
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(_segments, st.lists(st.integers(0, 200), max_size=4))
def test_any_reply_streams_like_whole_and_loses_no_text(
    segments: list[tuple[str, Any]], cuts: list[int]
) -> None:
    text = _render(segments)
    content, calls = whole(hermes(), text)
    pieces = cut(text, cuts)
    got_content, got_calls = streamed(hermes(), pieces)
    assert (got_content, got_calls) == (content or "", calls)
    # Every call written whole is a call unless a text segment opened a tag before it; all
    # other text is content (whitespace next to calls aside).
    expected = [value for kind, value in segments if kind == "call"]
    if "<tool_call>" not in "".join(v for k, v in segments if k == "text"):
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
        kept = "".join(value for kind, value in segments if kind != "call")
        assert "".join((content or "").split()) == "".join(kept.split())


@settings(max_examples=100, deadline=None)
@given(st.lists(_calls, min_size=1, max_size=3), st.lists(st.integers(0, 300), max_size=4))
def test_any_required_reply_streams_like_whole(
    calls: list[tuple[str, Any]], cuts: list[int]
) -> None:
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls], separators=(",", ":"))
    content, parsed = whole(CallsArrayParser(), text)
    assert content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed] == calls
    pieces = cut(text, cuts)
    assert streamed(CallsArrayParser(), pieces) == ("", parsed)
