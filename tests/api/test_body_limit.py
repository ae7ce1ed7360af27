"""The request-body limit (api/body_limit.py) in front of a real uvicorn on loopback: a body
over the limit is refused 413 in OpenAI's shape before the app reads it, whether its size is
declared (Content-Length) or only found while reading (chunked); one within it reaches the app
whole."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvrelay.api.body_limit import BodyLimitMiddleware
from tests.servers import free_port

LIMIT = 64 * 1024


SEEN: list[int] = []  # body sizes the app received


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    SEEN.append(len(body))
    return JSONResponse({"bytes": len(body)})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = BodyLimitMiddleware(Starlette(routes=[Route("/echo", echo, methods=["POST"])]), LIMIT)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(10)


def post(port: int, body: bytes, chunked: bool = False) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        if chunked:
            pieces = (body[i : i + 8192] for i in range(0, len(body), 8192))
            conn.request("POST", "/echo", body=pieces, encode_chunked=True)
        else:
            conn.request("POST", "/echo", body=body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_within_the_limit_reaches_the_app_whole(port: int, chunked: bool) -> None:
    assert post(port, b"x" * LIMIT, chunked) == (200, {"bytes": LIMIT})
    assert post(port, b"", chunked) == (200, {"bytes": 0})


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_refused_before_the_app_sees_it(port: int, chunked: bool) -> None:
    SEEN.clear()
    started = time.monotonic()
    status, body = post(port, b"x" * (20 * LIMIT), chunked)
    assert time.monotonic() - started < 5
    assert status == 413
    assert body == {
        "error": {
            "message": f"the request body is larger than {LIMIT} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": 413,
        }
    }
    assert SEEN == []
    assert post(port, b"y" * 10) == (200, {"bytes": 10})  # the server goes on serving


@pytest.mark.parametrize("raw", [b'{"prompt": "ab\xed\xa0\x80c"}', b'{"prompt": "\xff"}'])
def test_a_body_that_is_not_utf8_is_refused_as_a_whole(port: int, raw: bytes) -> None:
    SEEN.clear()
    status, body = post(port, raw)
    assert status == 400
    assert body["error"]["param"] is None
    assert "not valid UTF-8" in body["error"]["message"]
    assert SEEN == []
