"""A worker's output-stream listener (the wire: common/stream_wire.py): one port per worker, one
connection per router, each carrying one output channel's batches (worker/output_channels.py).

It lives on the worker's event loop, where the channels live: a connection's task reads the
channel's batches and writes each as a frame; when the router hangs up, the channel closes and
aborts the requests still running on it. It listens where the KV server does (transfer/
network.py: loopback unless the pod says otherwise) and serves nobody who cannot prove the
channel's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvrelay.common.stream_wire import (
    HANDSHAKE_TIMEOUT_S,
    HELLO_BYTES,
    ChannelAddress,
    frame,
    new_key,
    parse_hello,
    proves,
    worker_proof,
)

if TYPE_CHECKING:
    from kvrelay.worker.output_channels import OutputChannel

logger = logging.getLogger(__name__)

# How long an opened channel's key waits for its router to connect (a router connects at
# once; this bounds a key that is never used).
KEY_TTL_S = 60.0


class StreamServer:
    """Serves `channel_of(channel_id)`'s batches to the router holding that channel's key;
    `forget(channel_id, channel)` once its connection ends."""

    def __init__(
        self,
        channel_of: Callable[[str], OutputChannel],
        forget: Callable[[str, OutputChannel], None],
        host: str,
        advertise_host: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._channel_of = channel_of
        self._forget = forget
        self._host = host
        self._advertise_host = advertise_host
        self._tls = tls
        self._keys: dict[str, bytes] = {}
        self._server: asyncio.Server | None = None
        self._port = 0
        self._connections: set[asyncio.Task[None]] = set()

    async def open(self, channel_id: str) -> ChannelAddress:
        """A fresh key for `channel_id` and where to connect with it (listening from the
        first call on). The key is good for one connection, within KEY_TTL_S."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self._host, 0, ssl=self._tls)
            self._port = self._server.sockets[0].getsockname()[1]
        key = self._keys[channel_id] = new_key()
        asyncio.get_running_loop().call_later(KEY_TTL_S, self._expire, channel_id, key)
        return ChannelAddress(self._advertise_host, self._port, channel_id, key)

    def close(self) -> None:
        """Stop listening and end every connection (their channels abort their requests)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        self._keys.clear()

    def revoke(self, channel_id: str) -> None:
        """`channel_id`'s key no longer admits a connection (its channel was closed)."""
        self._keys.pop(channel_id, None)

    def _expire(self, channel_id: str, key: bytes) -> None:
        if self._keys.get(channel_id) is key:
            del self._keys[channel_id]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            channel_id = await self._handshake(reader, writer)
            if channel_id is not None:
                await self._pump(channel_id, reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            logger.debug("an output stream connection ended: %r", exc)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> str | None:
        """The proven router's channel id; None (the connection is closed, unanswered) when
        it proves nothing in time."""
        data = await asyncio.wait_for(reader.readexactly(HELLO_BYTES), HANDSHAKE_TIMEOUT_S)
        channel_id, proof = parse_hello(data)
        key = self._keys.get(channel_id)
        if key is None or not proves(key, proof, worker=False):
            peer = writer.get_extra_info("peername")
            logger.warning("refused an output stream connection from %s: no valid key", peer)
            return None
        del self._keys[channel_id]  # one connection per key
        writer.write(worker_proof(key))
        return channel_id

    async def _pump(
        self, channel_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Send the channel's batches until either end stops; then close the channel."""
        channel = self._channel_of(channel_id)
        sender = asyncio.ensure_future(_send(channel, writer))
        hangup = asyncio.ensure_future(_until_eof(reader))
        try:
            await asyncio.wait({sender, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, hangup):
                task.cancel()
            await asyncio.gather(sender, hangup, return_exceptions=True)
            channel.close()
            self._forget(channel_id, channel)


async def _send(channel: OutputChannel, writer: asyncio.StreamWriter) -> None:
    async for batch in channel.batches():
        writer.write(frame(batch))
        await writer.drain()  # a router that reads slowly slows this channel only


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Returns when the router hangs up (it sends nothing after its hello)."""
    while await reader.read(4096):
        pass
