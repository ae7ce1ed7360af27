"""A worker's output channels: one long-lived stream per router instead of one per request.

A router opens a channel once per worker (`open_channel(channel_id)`, a Ray call that answers
where to connect: worker/stream_server.py) and starts requests with plain
`start(channel_id, tag, request)` calls: the workers' one output path. Each time the worker's
event loop runs it sends, as ONE frame on that connection, every delta that arrived since the
last batch, for all the router's requests here: per step one frame per router, not one message
per request.

Closing the channel (the router hung up, or never connected) aborts every request started on
it, as leaving a per-request stream did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

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
        """Forward one request's deltas (its stream: `OutputChannels`' `deltas`) under `tag`."""
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


DeltaStream = Callable[[EngineRequest], AsyncIterator[OutputDelta]]


class OutputChannels:
    """A worker's output channels, one per router (by the channel id it names), and the
    listener routers connect to; part of the worker actor (made in its `__init__`), whose
    `open_channel` and `start` calls land here. Its methods run on the actor's event loop
    (`close`: any thread)."""

    def __init__(self, deltas: DeltaStream) -> None:
        """`deltas`: one request's stream of deltas (worker/deltas.py's `request_deltas`);
        leaving it early aborts the request."""
        self._deltas = deltas
        self._channels: dict[str, OutputChannel] = {}
        self._server: StreamServer | None = None  # listening from the first `open`
        self._loop: asyncio.AbstractEventLoop | None = None  # the channels' loop, once known

    @property
    def ids(self) -> list[str]:
        """The ids of the channels open now."""
        return list(self._channels)

    async def open(self, channel_id: str) -> ChannelAddress:
        """Where the router that named `channel_id` (a uuid4's hex) connects for the batches
        of the requests it starts with that id, and the single-use key it proves itself with
        (common/stream_wire.py). Connecting ends when either side hangs up, and that ends
        the channel: its requests still running are aborted."""
        if len(channel_id) != CHANNEL_ID_BYTES or set(channel_id) - _HEX_DIGITS:
            raise ValueError(f"a channel id is {CHANNEL_ID_BYTES} hex digits")
        self._channel(channel_id)
        if self._server is None:
            network = KVNetwork.from_env()
            self._server = StreamServer(
                self._channel, self._forget, network.host, network.peer_host, server_tls()
            )
        return await self._server.open(channel_id)

    def start(self, channel_id: str, tag: int, request: EngineRequest) -> None:
        """Start `request`, its deltas sent on `channel_id` under `tag` (a start may come
        before its channel is opened). Its failure comes on the channel."""
        self._channel(channel_id).start(tag, self._deltas(request))

    def close(self) -> None:
        """Stop listening for routers; every channel closes (its requests are aborted). Any
        thread may call it: the closing runs on the loop the channels live on."""
        loop = self._loop
        if loop is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._close_now()
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nothing is open
                loop.call_soon_threadsafe(self._close_now)

    def _close_now(self) -> None:
        if self._server is not None:
            self._server.close()
        for channel in self._channels.values():
            channel.close()

    def _channel(self, channel_id: str) -> OutputChannel:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        channel = self._channels.get(channel_id)
        if channel is None or channel.closed:
            channel = self._channels[channel_id] = OutputChannel()
            # A channel nobody connects to (its router died before it could) would run its
            # requests to the end for no one: close it.
            loop.call_later(KEY_TTL_S, self._close_unclaimed, channel_id, channel)
        return channel

    def _close_unclaimed(self, channel_id: str, channel: OutputChannel) -> None:
        if not channel.claimed:
            logger.warning("output channel %s was never connected: closing it", channel_id)
            # Its key's own timer may fire a moment later: a router proving it in between
            # would get a fresh channel that no request feeds, and wait on it for ever.
            if self._server is not None:
                self._server.revoke(channel_id)
            channel.close()
            self._forget(channel_id, channel)

    def _forget(self, channel_id: str, channel: OutputChannel) -> None:
        if self._channels.get(channel_id) is channel:
            del self._channels[channel_id]
