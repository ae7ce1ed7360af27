"""Noticing a client that went away, so its request is aborted at once and its KV freed.

Starlette only watches for `http.disconnect` under ASGI spec < 2.4; under 2.4 (uvicorn) a gone
client shows up only as a failed write, and the body generator is left to the garbage
collector. Here both responses watch the connection themselves and cancel the work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGoneError(Exception):
    """The client disconnected before the response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (ClientGoneError)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        # Both ended before we look at them: a task cancelled a moment ago is not done yet,
        # and asking it for a result then would raise InvalidStateError.
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGoneError()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops and closes its generator the moment the client leaves."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close  # runs even if the stream never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.create_task(self._stream(send))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self._events.aclose()  # runs the generator's cleanup: aborts the request
            if self._on_close is not None:
                self._on_close()

    async def _stream(self, send: Send) -> Any:
        with contextlib.suppress(OSError):  # the client left mid-write
            await self.stream_response(send)
