"""Hypothesis strategies for hostile request bodies: every known field of /v1/completions and
/v1/chat/completions with arbitrary JSON, numbers at and past every boundary, strings with
surrogates / NUL, bodies of several MB and deeply nested ones.

Valid numbers are kept tiny where they size the work (max_tokens, n, min_tokens): a request
that succeeds must cost a fraction of a second, or the suite cannot run in CI.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.fuzz.corpus import CHAT, COMPLETIONS, MAX_BODY_BYTES, nested

BOUNDARY_INTS = (
    0, -1, 1, 2, 3, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
    2**64 - 1, 2**64, 10**30,
)  # fmt: skip
BOUNDARY_FLOATS = (
    0.0, -0.0, 0.5, 1.0, 1.5, 2.5, 1e-300, 1e-40, 5e-324, 1e300, -1e300, math.nan, math.inf,
    -math.inf,
)  # fmt: skip
# Raw JSON that json.dumps cannot write (nesting past Python's recursion limit), spliced in.
RAW_PREFIX = "\x00raw:"
RAW_JSON = {f"{RAW_PREFIX}{depth}": nested(depth) for depth in (64, 1_000, 100_000)}
# Big values, built once: past the context (refused after tokenizing or before), a few MB
# under the body limit, and past it (413).
BIG_STRINGS = (
    "a " * 20_000,
    "hello " * 170_000,
    "x" * 3_000_000,
    "a " * (MAX_BODY_BYTES // 2 + 1),
)
SIZE_FIELDS = {"max_tokens", "max_completion_tokens", "n", "min_tokens", "best_of"}

COMMON_FIELDS = (
    "model", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
    "stop", "stream", "stream_options", "user", "logit_bias", "top_k", "min_p", "min_tokens",
    "ignore_eos", "stop_token_ids", "repetition_penalty", "include_stop_str_in_output",
    "skip_special_tokens", "max_tokens", "allowed_token_ids", "truncate_prompt_tokens",
    "return_token_ids", "return_tokens_as_token_ids", "request_id", "add_special_tokens",
)  # fmt: skip
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "logprobs", "echo", "suffix", "best_of")
CHAT_FIELDS = (
    *COMMON_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
    "add_generation_prompt", "tools",
)  # fmt: skip
KNOWN_FIELDS = {COMPLETIONS: set(COMPLETION_FIELDS), CHAT: set(CHAT_FIELDS)}
BASES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 2},
    # Both limits: setting one to null leaves the other (an unbounded chat takes minutes).
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
           "max_completion_tokens": 2},
}  # fmt: skip

# Fields whose value can make another one's error: a 400 may name either.
INTERACTS = {
    "max_tokens": {"prompt", "messages", "n", "min_tokens", "max_completion_tokens"},
    "max_completion_tokens": {"messages", "n", "min_tokens", "max_tokens"},
    "n": {"max_tokens", "max_completion_tokens", "best_of"},
    "min_tokens": {"max_tokens", "max_completion_tokens"},
    "best_of": {"n"},
    "logprobs": {"top_logprobs"},
    "top_logprobs": {"logprobs"},
    "stream_options": {"stream"},
    "stream": {"stream_options"},
    "prompt": {"max_tokens"},
    "messages": {"max_tokens", "max_completion_tokens", "add_generation_prompt"},
    "add_generation_prompt": {"messages"},
}

TEXT_ALPHABET = st.sampled_from(["a", " ", "é", "漢", "\x00", "\ud800", "\udfff", "\ufffe", "\n"])
texts = st.text(max_size=12) | st.text(TEXT_ALPHABET, max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.sampled_from(BOUNDARY_INTS)
    | st.integers(-5, 5)
    | st.sampled_from(BOUNDARY_FLOATS)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
# Anything a field may be sent: JSON, boundaries, big strings, very deep nesting.
any_value = json_values | st.sampled_from(BIG_STRINGS) | st.sampled_from(sorted(RAW_JSON))
# Sizing fields: the same hostile shapes, but only tiny valid numbers.
size_value = (
    st.none()
    | st.booleans()
    | st.sampled_from(BOUNDARY_INTS)
    | st.sampled_from(BOUNDARY_FLOATS)
    | st.sampled_from(["2", "x", "", "1e3", "\ud800"])
    | st.lists(st.integers(0, 3), max_size=2)
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bogus", "", "SYSTEM"])
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles | texts},
        optional={"content": texts | st.sampled_from(BIG_STRINGS) | json_values, "name": texts},
    ),
    max_size=3,
)
token_lists = st.lists(st.sampled_from(BOUNDARY_INTS), max_size=4)
prompts = texts | st.sampled_from(BIG_STRINGS) | token_lists
unknown_names = st.sampled_from(["padding", "foo", "", "\ud800", "extra_body", "__proto__"]) | texts


def value_for(field: str) -> st.SearchStrategy[Any]:
    if field in SIZE_FIELDS:
        return size_value
    if field == "messages":
        return messages | any_value
    if field == "prompt":
        return prompts | any_value
    return any_value


@dataclass(frozen=True)
class Body:
    """A body as sent, and what it was built from (to judge the answer)."""

    raw: bytes
    fields: tuple[str, ...]  # the fields set or changed from the base


def encode(payload: Any, raw_utf8: bool) -> bytes:
    """JSON with NaN / Infinity written raw (a JSON extension); lone surrogates escaped
    (\\ud800) or, with `raw_utf8`, written as their invalid UTF-8 bytes (ED A0 80)."""
    text = json.dumps(payload, ensure_ascii=not raw_utf8)
    data = text.encode("utf-8", "surrogatepass")
    for key, raw in RAW_JSON.items():
        marker = json.dumps(key, ensure_ascii=not raw_utf8).encode()
        data = data.replace(marker, raw.encode())
    return data


@st.composite
def one_field_bodies(draw: st.DrawFn, path: str) -> Body:
    """The valid base body with exactly one field (known or unknown) set to anything."""
    known = sorted(KNOWN_FIELDS[path])
    field = draw(st.sampled_from(known) | unknown_names)
    payload = {**BASES[path], field: draw(value_for(field) if field in known else any_value)}
    return Body(encode(payload, draw(st.booleans())), (field,))


@st.composite
def many_field_bodies(draw: st.DrawFn, path: str) -> Body:
    """The base with several fields set at once, or a body that is not an object at all."""
    if draw(st.integers(0, 9)) == 0:
        top = draw(json_values | st.sampled_from(sorted(RAW_JSON)))
        return Body(encode(top, draw(st.booleans())), ())
    names = draw(st.lists(st.sampled_from(sorted(KNOWN_FIELDS[path])), max_size=5, unique=True))
    payload = dict(BASES[path])
    for name in names:
        payload[name] = draw(value_for(name))
    unbounded = payload.get("max_tokens") is None and payload.get("max_completion_tokens") is None
    if path == CHAT and unbounded:
        # Both limits null is a valid chat without a bound: up to the context length, minutes
        # of decoding here. Keep one bound; max_tokens is then not a field under test.
        payload["max_tokens"] = 2
        names = [name for name in names if name != "max_tokens"]
    if draw(st.booleans()):
        payload[draw(unknown_names)] = draw(any_value)
    return Body(encode(payload, draw(st.booleans())), tuple(names))


raw_bodies = st.binary(max_size=64) | st.sampled_from(
    [b"{", b'{"prompt": "a", }', b"\xff\xfe{}", b'{"prompt": NaN}', b"null", b"{}" * 3, b"\x00"]
)


# Deterministic in CI; sized so that the whole fuzz suite takes a few minutes on 2 cores.
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
        HealthCheck.filter_too_much,
    ],
)
