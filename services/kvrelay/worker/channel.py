"""A worker's output channels: one long-lived stream per router instead of one per request.

A router opens a channel once per worker (`open_channel(channel_id)`, a Ray call that answers
where to connect: worker/stream_server.py) and starts requests with plain
`start(channel_id, tag, ...)` calls. Each time the worker's event loop runs it sends, as ONE
frame on that connection, every delta that arrived since the last batch, for all the router's
requests here: per step one frame per router, not one message per request.

Closing the channel (the router hung up, or never connected) aborts every request started on
it, as leaving a per-request stream did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kvrelay.common.messages import ChannelItem, EngineRequest, OutputDelta, RequestFailedError
from kvrelay.common.stream_wire import CHANNEL_ID_BYTES, ChannelAddress, server_tls
from kvrelay.transfer.network import KVNetwork
from kvrelay.worker.stream_server import KEY_TTL_S, StreamServer

logger = logging.getLogger(__name__)
_HEX_DIGITS = frozenset("0123456789abcdef")


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
        self.claimed = False  # a listener has taken its batches

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
        self.claimed = True
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
    """The `open_channel` / `start` pair of a worker actor, over its per-request `generate`;
    a mixin for EngineWorker (and the router tests' fake worker). Its methods run on the
    actor's event loop."""

    _channels: dict[str, OutputChannel]
    _streams: StreamServer | None
    _loop: asyncio.AbstractEventLoop

    def generate(self, request: EngineRequest) -> AsyncIterator[OutputDelta]:
        raise NotImplementedError

    async def open_channel(self, channel_id: str) -> ChannelAddress:
        """Where the router that named `channel_id` (a uuid4's hex) connects for the batches
        of the requests it starts with that id, and the single-use key it proves itself with
        (common/stream_wire.py). Connecting ends when either side hangs up, and that ends
        the channel: its requests still running are aborted."""
        if len(channel_id) != CHANNEL_ID_BYTES or set(channel_id) - _HEX_DIGITS:
            raise ValueError(f"a channel id is {CHANNEL_ID_BYTES} hex digits")
        self._channel(channel_id)
        if getattr(self, "_streams", None) is None:
            network = KVNetwork.from_env()
            self._streams = StreamServer(
                self._channel, self._forget_channel, network.host, network.peer_host, server_tls()
            )
        assert self._streams is not None
        return await self._streams.open(channel_id)

    def close_streams(self) -> None:
        """Stop listening for routers; every channel closes (its requests are aborted). Any
        thread may call it: the closing runs on the loop the channels live on."""
        loop: asyncio.AbstractEventLoop | None = getattr(self, "_loop", None)
        if loop is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._close_streams_now()
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nothing is open
                loop.call_soon_threadsafe(self._close_streams_now)

    def _close_streams_now(self) -> None:
        streams = getattr(self, "_streams", None)
        if streams is not None:
            streams.close()
        for channel in self._channels.values():
            channel.close()

    def _channel(self, channel_id: str) -> OutputChannel:
        if not hasattr(self, "_channels"):
            self._channels = {}
            self._loop = asyncio.get_running_loop()
        channel = self._channels.get(channel_id)
        if channel is None or channel.closed:
            channel = self._channels[channel_id] = OutputChannel()
            # A channel nobody connects to (its router died before it could) would run its
            # requests to the end for no one: close it.
            loop = asyncio.get_running_loop()
            loop.call_later(KEY_TTL_S, self._close_unclaimed, channel_id, channel)
        return channel

    def _close_unclaimed(self, channel_id: str, channel: OutputChannel) -> None:
        if not channel.claimed:
            logger.warning("output channel %s was never connected: closing it", channel_id)
            channel.close()
            self._forget_channel(channel_id, channel)

    def _forget_channel(self, channel_id: str, channel: OutputChannel) -> None:
        if self._channels.get(channel_id) is channel:
            del self._channels[channel_id]

    async def start(self, channel_id: str, tag: int, request: EngineRequest) -> None:
        """Start `request`, its deltas sent on `channel_id` under `tag` (see `generate`);
        returns once it is queued. Its failure comes on the channel."""
        self._channel(channel_id).start(tag, self.generate(request))
