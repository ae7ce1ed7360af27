"""Property tests of the HTTP input contract against the session's `kvrelay serve`: any body
to /v1/completions and /v1/chat/completions gets no 5xx, errors in OpenAI's shape with
`param` naming the field at fault, while a victim stream keeps its exact tokens, /health
answers within 1 s and the pools end with no KV block in use."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import httpx
import pytest
from hypothesis import given

from tests.api.metrics import pools_idle, wait_for
from tests.fuzz.corpus import CHAT, COMPLETIONS
from tests.fuzz.guard import Guard, http_victim
from tests.fuzz.strategies import (
    FUZZ,
    INTERACTS,
    KNOWN_FIELDS,
    Body,
    many_field_bodies,
    one_field_bodies,
    raw_bodies,
)
from tests.fuzz.wire import HttpAnswer, check_http, check_param_rule, send, strict_object
from tests.servers import ServerProcess

# alone: /health and kill-recovery bounds in wall time (Makefile: RUN_SUITE).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.alone]
PATHS = [COMPLETIONS, CHAT]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client() as client:
        yield client


def guarded(server: ServerProcess, traffic: Callable[[], None]) -> None:
    """Run `traffic` beside a victim stream and a /health poller, then check both and that
    every KV block was given back."""
    with Guard(lambda: http_victim(server.http_url), f"{server.http_url}/health") as guard:
        traffic()
    guard.check()
    idle = wait_for(server, pools_idle, timeout_s=30)
    assert pools_idle(idle), idle.samples


def post(client: httpx.Client, server: ServerProcess, path: str, body: Body) -> HttpAnswer:
    answer = send(client, server.http_url + path, body.raw, timeout_s=60)
    payload = strict_object(body.raw)
    # `"stream": true` must stream; other values JSON coerces to a bool (1, "yes": pydantic's
    # lax mode, as vLLM's server reads them) may too, and the answer's type says which.
    if answer.status == 200 and payload is not None and payload.get("stream") is True:
        assert answer.is_event_stream, answer.content_type
    error = check_http(answer, answer.is_event_stream)
    if error is not None:
        check_param_rule(error, answer.status, body.raw, KNOWN_FIELDS[path])
    return answer


@pytest.mark.parametrize("path", PATHS)
def test_one_bad_field_is_named(
    kvrelay_server: ServerProcess, http: httpx.Client, path: str
) -> None:
    """The base body with one field set to anything: a 400 names that field (or one whose
    meaning it changes, INTERACTS), never another or none."""

    @FUZZ
    @given(body=one_field_bodies(path))
    def run(body: Body) -> None:
        answer = post(http, kvrelay_server, path, body)
        if answer.status != 400:
            return
        param = answer.json()["error"]["param"]
        if param is None:  # a body-level refusal: post() checked that it may be one
            return
        (field,) = body.fields
        # A name sent as two surrogate escapes is one character once the server decodes it.
        allowed = {field, json.loads(json.dumps(field))} | INTERACTS.get(field, set())
        # (A field whose own name holds a dot is named whole.)
        assert param in allowed or re.split(r"[.\[]", param)[0] in allowed, (field, param)

    guarded(kvrelay_server, run)


@pytest.mark.parametrize("path", PATHS)
def test_any_body_keeps_the_contract(
    kvrelay_server: ServerProcess, http: httpx.Client, path: str
) -> None:
    """Several fields at once, bodies that are not objects, and raw bytes."""

    @FUZZ
    @given(body=many_field_bodies(path) | raw_bodies.map(lambda raw: Body(raw, ())))
    def run(body: Body) -> None:
        post(http, kvrelay_server, path, body)

    guarded(kvrelay_server, run)
