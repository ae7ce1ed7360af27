"""A limit on request bodies, as ASGI middleware in front of the HTTP app (which also
refuses bodies that are not UTF-8, since it holds the raw bytes).

Without it a 20 MB body was parsed, validated and tokenized, costing every other client 28 s
and the router 2.7 GB. The body is read here, up to `max_bytes`, before the app sees it: a
larger one is answered 413 (OpenAI's error shape) at once, without parsing a byte of it. The
rest of an oversized body is read and dropped (up to a bound) so that the client, still
sending, gets the 413 instead of a reset connection.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Past this much of an oversized body, stop reading and let the connection close.
_DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, declared)
            await self._refuse(send)
            return
        body, complete = await self._read(receive)
        if not complete:
            await _drain(receive, _DRAIN_LIMIT_BYTES)
            await self._refuse(send)
            return
        if not _is_utf8(body):
            await _send_error(send, 400, "the body is not valid UTF-8 (JSON text must be)")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> tuple[bytes, bool]:
        """The whole body, or (what was read, False) once it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return b"", False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    async def _refuse(self, send: Send) -> None:
        message = f"the request body is larger than {self.max_bytes} bytes"
        await _send_error(send, 413, message, close=True)


def _is_utf8(body: bytes) -> bool:
    """Whether the body is well-formed UTF-8. Python's json reads ill-formed bytes (ED A0 80)
    as a lone surrogate inside a string; refused here, they are an error of the body."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def _send_error(send: Send, status: int, message: str, close: bool = False) -> None:
    """An error in OpenAI's shape, sent before the app has seen the request."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:  # the rest of an oversized body may still be on its way
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, limit: int) -> None:
    """Read and drop the body's rest, up to `limit` bytes."""
    seen = 0
    while seen <= min(limit, _DRAIN_LIMIT_BYTES):
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then waits on the real one (so the app
    still hears about a client that disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            message: dict[str, Any] = {"type": "http.request", "body": body, "more_body": False}
            return message
        return await receive()

    return replayed
