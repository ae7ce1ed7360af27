"""Sending raw requests to a real server and checking the contract every answer must keep:
no 5xx / UNKNOWN / INTERNAL, OpenAI's error shape, `param` naming the field at fault.

Raw on purpose: the bytes reach the server exactly as built (invalid UTF-8, NaN, 20 MB).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import grpc
import httpx

from tests.fuzz.corpus import Param

ERROR_KEYS = {"message", "type", "param", "code"}
# A body nested deeper than this may be refused whole (param null) as "nested too deeply".
DEEP = 500
GENERATE = "/kvrelay.v1.Generation/Generate"
# What gRPC may answer a hostile request; UNKNOWN / INTERNAL mean the server broke.
GRPC_ACCEPTABLE = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}


@dataclass
class HttpAnswer:
    status: int
    raw: bytes
    elapsed_s: float
    content_type: str = ""

    @property
    def is_event_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def json(self) -> Any:
        return json.loads(self.raw)


def send(
    client: httpx.Client, url: str, body: bytes, method: str = "POST", timeout_s: float = 120
) -> HttpAnswer:
    """One request with these exact bytes; a streamed answer is read to its end. A broken
    connection is status 0 with the error as the body (a failure, never a pass)."""
    headers = {"Content-Type": "application/json"}
    started = time.monotonic()
    try:
        with client.stream(method, url, content=body, headers=headers, timeout=timeout_s) as reply:
            raw = reply.read()
    except httpx.TransportError as exc:
        return HttpAnswer(0, repr(exc).encode(), time.monotonic() - started)
    content_type = reply.headers.get("content-type", "")
    return HttpAnswer(reply.status_code, raw, time.monotonic() - started, content_type)


def param_matches(expected: Param, actual: object) -> bool:
    """`expected` as corpus.Param: None, an exact path, "x*" (x or x.<...>), or alternatives."""
    if isinstance(expected, tuple):
        return any(param_matches(e, actual) for e in expected)
    if expected is None or actual is None:
        return expected is actual
    if not isinstance(actual, str):
        return False
    if expected.endswith("*"):
        return actual == expected[:-1] or actual.startswith(expected[:-1] + ".")
    return actual == expected


def error_of(answer: HttpAnswer) -> dict[str, Any]:
    """The `error` object of a non-2xx answer, after checking it is exactly OpenAI's shape."""
    try:
        payload = answer.json()
    except ValueError as exc:
        raise AssertionError(f"HTTP {answer.status}, not JSON: {answer.raw[:300]!r}") from exc
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, payload
    assert isinstance(error["message"], str) and error["message"], payload
    assert isinstance(error["type"], str) and error["type"], payload
    assert error["param"] is None or isinstance(error["param"], str), payload
    assert error["code"] is None or isinstance(error["code"], (int, str)), payload
    return error


def stream_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    lines = raw.decode("utf-8", errors="replace").splitlines()
    return [line[len("data:") :].strip() for line in lines if line.startswith("data:")]


def check_stream(answer: HttpAnswer) -> None:
    """A 200 stream ends with `data: [DONE]` and carries no error event."""
    events = stream_events(answer.raw)
    assert events and events[-1] == "[DONE]", answer.raw[-500:]
    for event in events[:-1]:
        assert '"error"' not in event or "choices" in event, event


def check_http(answer: HttpAnswer, streamed: bool) -> dict[str, Any] | None:
    """The invariants of every HTTP answer; returns the error object of a non-2xx one."""
    assert 100 <= answer.status < 500, (answer.status, answer.raw[:500])
    if answer.status == 200:
        if streamed:
            check_stream(answer)
        else:
            json.loads(answer.raw)  # a whole answer is one JSON document
        return None
    return error_of(answer)


def strict_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object if it is one in the strict sense (valid UTF-8, no NaN or
    Infinity); None otherwise."""

    def no_constants(name: str) -> None:
        raise ValueError(name)

    try:
        payload = json.loads(body.decode("utf-8"), parse_constant=no_constants)
        # A key that is not Unicode text (a lone surrogate escape) cannot be named either.
        if isinstance(payload, dict):
            "".join(payload).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return payload if isinstance(payload, dict) else None


def lenient_keys(body: bytes) -> set[str]:
    """The top-level keys a lenient reader (NaN, Infinity and bad UTF-8 allowed) finds."""
    try:
        payload = json.loads(body.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return set()
    return set(payload) if isinstance(payload, dict) else set()


def lenient_parse_fails(body: bytes) -> bool:
    """Even a lenient reader (NaN, Infinity and bad UTF-8 allowed) finds no JSON object."""
    try:
        payload = json.loads(body.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return True
    return not isinstance(payload, dict)


def nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest in `body` (brackets inside strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def check_param_rule(error: dict[str, Any], status: int, body: bytes, known: set[str]) -> None:
    """`param` is null only for body-level errors; otherwise it starts with a field the body
    sent or the schema knows (a missing required field is named too)."""
    param = error["param"]
    if status in (404, 405, 413) or lenient_parse_fails(body):
        assert param is None, error
        return
    if status != 400:
        return  # 429 and the like are about the server, not a field
    payload = strict_object(body)
    if payload is None or nesting_depth(body) > DEEP:
        # NaN / Infinity, invalid UTF-8 or deep nesting: refusing the whole body (null) or
        # the field is fine: a known one, or one the body sent (an unknown field is refused
        # by name before its value is read).
        sent = lenient_keys(body)
        assert param is None or param in sent or param.split(".")[0] in known | sent, error
        return
    assert param is not None, f"a 400 on a JSON object must name the field: {error}"
    top = re.split(r"[.\[]", param)[0]
    assert top in payload or top in known or param in payload, error  # "a.b" named whole


def call_raw(
    channel: grpc.Channel, request: bytes, timeout_s: float = 120
) -> tuple[str, str, list[bytes]]:
    """Generate with these exact bytes: (status code name, details, raw responses)."""
    call = channel.unary_stream(
        GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    responses: list[bytes] = []
    try:
        for response in call(request, timeout=timeout_s):
            responses.append(response)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or "", responses
    return "OK", "", responses


def check_grpc(code: str, details: str, field: str | None = None) -> None:
    """No UNKNOWN / INTERNAL; INVALID_ARGUMENT's details start with the field at fault."""
    assert code in GRPC_ACCEPTABLE, (code, details)
    if field is not None:
        assert code == "INVALID_ARGUMENT", (code, details)
        assert re.match(rf"(sampling\.)?{re.escape(field)}\b", details), (field, details)
