"""The seed corpus of issue 12: every concrete hostile or careless input found so far, as data
(api, what is sent, the expected status or gRPC code, the expected `param` / field).

Pure data and tiny builders: no server, no pytest, so the regression tests and the fuzzers
read the same cases. Bodies omit `model` (the server's only model is the default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvrelay.api.body_limit import DEFAULT_MAX_BODY_BYTES
from kvrelay.v1 import generation_pb2 as pb

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES  # the server's default --max-body-bytes

# An expected `param`: None (body-level error), an exact field path, "messages*" for
# "messages" or any "messages.<...>" path, or a tuple of such alternatives.
Param = str | None | tuple[str | None, ...]


@dataclass(frozen=True)
class HttpCase:
    id: str
    path: str
    body: bytes
    status: int
    param: Param = None
    method: str = "POST"

    @property
    def streams(self) -> bool:
        """A 200 for this body is an SSE stream (it must end with `data: [DONE]`)."""
        try:
            payload = json.loads(self.body)
        except (ValueError, RecursionError):
            return False
        return isinstance(payload, dict) and payload.get("stream") is True


@dataclass(frozen=True)
class GrpcCase:
    id: str
    request: bytes  # a serialized GenerateRequest, or malformed bytes
    code: str  # grpc.StatusCode name
    field: str | None = None  # the field the details must start with (INVALID_ARGUMENT)


def body(payload: Any) -> bytes:
    """JSON as a strict client writes it: lone surrogates escaped (\\ud800), never raw."""
    return json.dumps(payload).encode()


def completion(**fields: Any) -> bytes:
    return body({"prompt": "Hello", "max_tokens": 2, **fields})


def chat(**fields: Any) -> bytes:
    return body({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# Raw bytes ED A0 80: a UTF-8-encoded lone surrogate (U+D800), which is invalid UTF-8.
RAW_SURROGATE = b"\xed\xa0\x80"


def _issue_cases() -> list[HttpCase]:
    """Points 1, 4 and 5 of the issue: inputs that crashed the engine, 500s, missing bounds."""
    killer = {"prompt": "Hello world, hello", "max_tokens": 4, "min_tokens": 2}
    big_seed = {"seed": 2**64 - 1, "n": 2}
    return [
        HttpCase("stop_token_ids_2_64", COMPLETIONS,
                 body({**killer, "stop_token_ids": [2**64]}), 400, "stop_token_ids"),
        HttpCase("stop_token_ids_2_63", COMPLETIONS,
                 body({**killer, "stop_token_ids": [2**63]}), 400, "stop_token_ids"),
        HttpCase("repetition_penalty_1e-300", COMPLETIONS,
                 completion(temperature=1.0, repetition_penalty=1e-300), 200),
        HttpCase("repetition_penalty_1e-40", COMPLETIONS,
                 completion(temperature=1.0, repetition_penalty=1e-40), 200),
        HttpCase("chat_repetition_penalty_1e-300", CHAT,
                 chat(temperature=1.0, repetition_penalty=1e-300), 200),
        HttpCase("seed_2_64_minus_1_n_2", COMPLETIONS, completion(**big_seed), 200),
        HttpCase("seed_2_64_minus_1_n_2_stream", COMPLETIONS,
                 completion(**big_seed, stream=True), 200),
        HttpCase("seed_2_64", COMPLETIONS, completion(seed=2**64), 400, "seed"),
        HttpCase("prompt_lone_surrogate", COMPLETIONS,
                 completion(prompt="abc \ud800 def"), 400, "prompt"),
        HttpCase("chat_lone_surrogate", CHAT,
                 body({"messages": [{"role": "user", "content": "abc \ud800 def"}],
                       "max_tokens": 2}), 400, "messages*"),
        HttpCase("prompt_raw_invalid_utf8", COMPLETIONS,
                 b'{"prompt": "abc ' + RAW_SURROGATE + b' def", "max_tokens": 2}', 400),
        HttpCase("chat_raw_invalid_utf8", CHAT,
                 b'{"messages": [{"role": "user", "content": "abc ' + RAW_SURROGATE
                 + b' def"}], "max_tokens": 2}', 400),
        HttpCase("n_256_max_tokens_8000", COMPLETIONS, completion(n=256, max_tokens=8000), 400,
                 "n"),
        HttpCase("n_3000", COMPLETIONS, completion(n=3000), 400, "n"),
        HttpCase("chat_n_3000", CHAT, chat(n=3000), 400, "n"),
        HttpCase("max_completion_tokens_0", CHAT,
                 chat(max_completion_tokens=0), 400, "max_completion_tokens"),
        HttpCase("max_completion_tokens_-1", CHAT,
                 chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ]  # fmt: skip


def _param_cases() -> list[HttpCase]:
    """Point 6: `param` names the field at fault (it named the wrong one, or none)."""
    return [
        HttpCase("top_logprobs_21", CHAT, chat(logprobs=True, top_logprobs=21), 400,
                 "top_logprobs"),
        HttpCase("echo_on_chat", CHAT, chat(echo=True), 400, "echo"),
        HttpCase("prompt_logprobs_streamed", COMPLETIONS,
                 completion(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
        HttpCase("suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
        HttpCase("best_of_2", COMPLETIONS, completion(best_of=2), 400, "best_of"),
        HttpCase("tools_bad_name", CHAT,
                 chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400,
                 "tools.0.function.name"),
        HttpCase("tool_choice_unknown_function", CHAT,
                 chat(tools=[{"type": "function", "function": {"name": "f"}}],
                      tool_choice={"type": "function", "function": {"name": "g"}}), 400,
                 "tool_choice.function.name"),
        HttpCase("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
        HttpCase("tool_role_without_id", CHAT,
                 body({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}),
                 400, "messages.0.tool_call_id"),
        HttpCase("chat_role_bogus", CHAT,
                 body({"messages": [{"role": "bogus", "content": "Hi"}], "max_tokens": 2}),
                 400, "messages*"),
    ]  # fmt: skip


def _body_level_cases() -> list[HttpCase]:
    """Point 6 and the size limit: errors about the body as a whole (param null)."""
    deep = nested(100_000).encode()
    return [
        HttpCase("invalid_json", CHAT, b'{"messages": [', 400),
        HttpCase("not_an_object_list", COMPLETIONS, b"[]", 400),
        HttpCase("not_an_object_string", COMPLETIONS, b'"hello"', 400),
        HttpCase("not_an_object_number", COMPLETIONS, b"1", 400),
        HttpCase("empty_body", COMPLETIONS, b"", 400),
        HttpCase("deeply_nested_top_level", COMPLETIONS, deep, 400),
        # The parser may give up (body-level) or read it and refuse the prompt's type.
        HttpCase("deeply_nested_prompt", COMPLETIONS, b'{"prompt": ' + deep + b"}", 400,
                 (None, "prompt")),
        HttpCase("nested_prompt_200_deep", COMPLETIONS,
                 b'{"prompt": ' + nested(200).encode() + b', "max_tokens": 2}', 400, "prompt"),
        HttpCase("unknown_path", "/v1/nope", completion(), 404),
        HttpCase("wrong_method_get", COMPLETIONS, b"", 405, method="GET"),
        HttpCase("wrong_method_delete", CHAT, b"", 405, method="DELETE"),
        HttpCase("over_limit_by_one", COMPLETIONS, _padded(MAX_BODY_BYTES + 1), 413),
        HttpCase("just_under_limit", COMPLETIONS, _padded(MAX_BODY_BYTES - 1024), 200),
        # No field silently ignored (issue 39): an unknown one is refused by name, nested too.
        HttpCase("unknown_field", COMPLETIONS, completion(padding="x"), 400, "padding"),
        HttpCase("unknown_nested_field", CHAT,
                 chat(stream=True, stream_options={"include_usage": True, "x": 1}), 400,
                 "stream_options.x"),
        HttpCase("two_constraints", CHAT,
                 chat(guided_regex="a", response_format={"type": "json_object"}), 400,
                 ("guided_regex", "response_format")),
    ]  # fmt: skip


def _padded(size: int) -> bytes:
    """A valid completion body of exactly `size` bytes, padded by a long `user` (a declared
    field: an unknown one is refused, issue 39)."""
    head = b'{"prompt": "Hello", "max_tokens": 2, "user": "'
    tail = b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


# Optional fields an explicit null must leave at their default (point 6).
NULLABLE_COMPLETION = (
    "n", "stream", "echo", "temperature", "max_tokens", "top_p", "seed", "stop", "logprobs",
    "suffix", "best_of", "include_stop_str_in_output", "ignore_eos", "min_tokens", "top_k",
    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids",
    "stream_options", "user", "logit_bias", "skip_special_tokens", "model",
)  # fmt: skip
NULLABLE_CHAT = (
    "n", "stream", "logprobs", "top_logprobs", "add_generation_prompt",
    "include_stop_str_in_output", "temperature", "max_tokens", "tools", "seed", "stop",
    "stream_options", "user", "repetition_penalty", "stop_token_ids", "model", "tool_choice",
    "parallel_tool_calls",
)  # fmt: skip


def _null_cases() -> list[HttpCase]:
    cases = [HttpCase(f"null_{f}", COMPLETIONS, completion(**{f: None}), 200)
             for f in NULLABLE_COMPLETION]  # fmt: skip
    # Chat keeps a bound when max_tokens is null: unbounded chat output would be minutes here.
    cases += [
        HttpCase(f"chat_null_{f}", CHAT, chat(max_completion_tokens=2, **{f: None}), 200)
        for f in NULLABLE_CHAT
    ]
    return cases


# Point 2: bodies of 20 MB, refused (413) within a second, before anything reads them whole.
def huge_prompt_body() -> bytes:
    return body({"prompt": "a " * 10_000_000})


def huge_unknown_field_body() -> bytes:
    return _padded(20_000_000)


HTTP_CASES: list[HttpCase] = _issue_cases() + _param_cases() + _body_level_cases() + _null_cases()


def generate(**fields: Any) -> bytes:
    """A serialized GenerateRequest; `sampling` given as a dict of SamplingOptions fields."""
    sampling = pb.SamplingOptions(**fields.pop("sampling", {}))
    return pb.GenerateRequest(sampling=sampling, **fields).SerializeToString()


def grpc_chat(role: str, content: str = "Hi") -> bytes:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role=role, content=content)])
    return generate(messages=messages, sampling={"max_tokens": 2})


def _raw_prompt(prompt: bytes) -> bytes:
    """GenerateRequest{prompt: <bytes as they are>}: field 3, length-delimited."""
    return b"\x1a" + bytes([len(prompt)]) + prompt


GRPC_CASES: list[GrpcCase] = [
    GrpcCase("repetition_penalty_1e-40", generate(
        prompt="Hello", sampling={"temperature": 1.0, "repetition_penalty": 1e-40,
                                  "max_tokens": 2}), "OK"),
    GrpcCase("seed_2_64_minus_1_n_2", generate(
        prompt="Hello", sampling={"seed": 2**64 - 1, "n": 2, "max_tokens": 2}), "OK"),
    GrpcCase("seed_2_64_minus_1_n_2_stream", generate(
        prompt="Hello", stream=True, sampling={"seed": 2**64 - 1, "n": 2, "max_tokens": 2}),
        "OK"),
    GrpcCase("n_3000", generate(prompt="Hello", sampling={"n": 3000, "max_tokens": 2}),
             "INVALID_ARGUMENT", "n"),
    GrpcCase("n_256_max_tokens_8000", generate(
        prompt="Hello", sampling={"n": 256, "max_tokens": 8000}), "INVALID_ARGUMENT", "n"),
    GrpcCase("max_tokens_0", generate(prompt="Hello", sampling={"max_tokens": 0}),
             "INVALID_ARGUMENT", "max_tokens"),
    GrpcCase("logprobs_50", generate(prompt="Hello", sampling={"logprobs": 50, "max_tokens": 2}),
             "INVALID_ARGUMENT", "logprobs"),
    GrpcCase("role_tool", grpc_chat("tool"), "INVALID_ARGUMENT", "messages"),
    GrpcCase("role_bogus", grpc_chat("bogus"), "INVALID_ARGUMENT", "messages"),
    GrpcCase("role_empty", grpc_chat(""), "INVALID_ARGUMENT", "messages"),
    GrpcCase("role_SYSTEM", grpc_chat("SYSTEM"), "INVALID_ARGUMENT", "messages"),
    GrpcCase("role_developer", grpc_chat("developer"), "OK"),
    GrpcCase("prompt_raw_invalid_utf8", _raw_prompt(b"abc " + RAW_SURROGATE + b" def"),
             "INVALID_ARGUMENT"),
    GrpcCase("malformed_ff", b"\xff\xff\xff\xff", "INVALID_ARGUMENT"),
    GrpcCase("malformed_truncated_varint", b"\x08", "INVALID_ARGUMENT"),
    GrpcCase("malformed_length_past_end", b"\x1a\x7fHello", "INVALID_ARGUMENT"),
    GrpcCase("malformed_wrong_wire_type", b"\x1d\x00\x00\x00\x00", "INVALID_ARGUMENT"),
    GrpcCase("no_input", b"", "INVALID_ARGUMENT"),
]  # fmt: skip
