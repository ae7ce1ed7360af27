"""A worker's output channels: one long-lived stream per router instead of one per request.

A router opens `channel(channel_id)` once per worker (a Ray streaming call) and starts
requests with plain `start(channel_id, tag, ...)` calls. Each time the worker's event loop runs
it sends, as ONE Ray object, every delta that arrived since the last batch, for all the
router's requests here: per step one object per router, not one per request (each object is a
report to the caller, a store entry and a wake-up in both processes).

Closing the channel (the router went away or cancelled it) aborts every request started on it,
as leaving a per-request stream did.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from kvrelay.messages import ChannelItem, KVHandle, OutputDelta, RequestFailedError

if TYPE_CHECKING:
    from kvrelay.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


def failure_item(tag: int, exc: BaseException) -> ChannelItem:
    """The channel's word for a stream that ended with `exc` (the router maps it back)."""
    if isinstance(exc, RequestFailedError):
        return ChannelItem(tag, error_kind="failed", error=str(exc))
    if isinstance(exc, ValueError):
        return ChannelItem(tag, error_kind="invalid", error=str(exc))
    logger.error("a request stream failed: %r", exc, exc_info=exc)
    return ChannelItem(tag, error_kind="internal", error=type(exc).__name__)


class OutputChannel:
    """One router's channel at this worker; lives on the worker's event loop."""

    def __init__(self) -> None:
        self._pending: list[ChannelItem] = []
        self._wake = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.closed = False

    def start(self, tag: int, deltas: AsyncIterator[OutputDelta]) -> None:
        """Forward one request's deltas (its stream, as `generate` yields them) under `tag`."""
        if self.closed:
            raise RuntimeError("this output channel is closed; open a new one")
        if tag in self._tasks:
            raise ValueError(f"stream tag {tag} is in use on this channel")
        self._tasks[tag] = asyncio.get_running_loop().create_task(self._forward(tag, deltas))

    async def batches(self) -> AsyncIterator[list[ChannelItem]]:
        """Every item since the last batch, as soon as there is one; closes the channel
        when the caller stops listening."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                items, self._pending = self._pending, []
                if items:
                    yield items
        finally:
            self.close()

    def close(self) -> None:
        """Abort the requests still running (cancelling a stream aborts its request)."""
        self.closed = True
        for task in self._tasks.values():
            task.cancel()

    def _push(self, item: ChannelItem) -> None:
        self._pending.append(item)
        self._wake.set()

    async def _forward(self, tag: int, deltas: AsyncIterator[OutputDelta]) -> None:
        try:
            async for delta in deltas:
                self._push(ChannelItem(tag, delta))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._push(failure_item(tag, exc))
        finally:
            self._tasks.pop(tag, None)


class ChannelEndpoint:
    """The `start` / `channel` pair of a worker actor, over its per-request `generate`; a
    mixin for EngineWorker (and the router tests' fake worker)."""

    _channels: dict[str, OutputChannel]

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_handle: KVHandle | None = None,
        resume_output_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[OutputDelta]:
        raise NotImplementedError

    def _channel(self, channel_id: str) -> OutputChannel:
        if not hasattr(self, "_channels"):
            self._channels = {}
        channel = self._channels.get(channel_id)
        if channel is None or channel.closed:
            channel = self._channels[channel_id] = OutputChannel()
        return channel

    async def start(
        self,
        channel_id: str,
        tag: int,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_handle: KVHandle | None = None,
        resume_output_token_ids: Sequence[int] = (),
    ) -> None:
        """Start a request whose deltas go out on `channel_id` under `tag` (see `generate`
        for the arguments); returns once it is queued. Its failure comes on the channel."""
        stream = self.generate(
            request_id, prompt_token_ids, params, kv_handle, resume_output_token_ids
        )
        self._channel(channel_id).start(tag, stream)

    async def channel(self, channel_id: str) -> AsyncIterator[list[ChannelItem]]:
        """The long-lived stream of `channel_id`'s batches; call it with
        `num_returns="streaming"` through Ray, once per router. Ending it aborts the
        requests started on it."""
        channel = self._channel(channel_id)
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]
