"""The router's end of the workers' output channels (worker/channel.py).

One long-lived Ray streaming call per worker carries, per batch, the deltas of every request
this router runs there; a pump task demultiplexes them by tag into per-stream inboxes. A
request is started with a plain `start` call. When the channel breaks (the worker died),
every stream on it gets the error, so each one migrates or retries as it would have when its
own stream broke; the next request opens a fresh channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from typing import Any

from kvrelay.messages import ChannelItem

logger = logging.getLogger(__name__)

Inbox = asyncio.Queue[ChannelItem | BaseException]


class ChannelClosedError(Exception):
    """The worker ended the channel (it shut down): its streams will send nothing more."""


class WorkerChannel:
    """This router's channel to one worker; made by `Channels.of`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.channel_id = uuid.uuid4().hex
        self._tags = itertools.count()
        self._inboxes: dict[int, Inbox] = {}
        self.broken: BaseException | None = None
        stream = handle.channel.options(num_returns="streaming").remote(self.channel_id)
        self._pump = asyncio.get_running_loop().create_task(self._run(stream))

    def open(self) -> tuple[int, Inbox]:
        """A new stream's tag and the inbox its items (or the channel's error) arrive in."""
        tag = next(self._tags)
        inbox: Inbox = asyncio.Queue()
        if self.broken is not None:
            inbox.put_nowait(self.broken)
        else:
            self._inboxes[tag] = inbox
        return tag, inbox

    def close(self, tag: int) -> None:
        """Stop routing `tag`'s items (late ones, an abort's final delta, are dropped)."""
        self._inboxes.pop(tag, None)

    def stop(self) -> None:
        self._pump.cancel()

    @property
    def streams(self) -> int:
        return len(self._inboxes)

    async def _run(self, stream: Any) -> None:
        try:
            async for ref in stream:
                batch: list[ChannelItem] = await ref
                for item in batch:
                    inbox = self._inboxes.get(item.tag)
                    if inbox is not None:
                        inbox.put_nowait(item)
            self._break(ChannelClosedError("the worker closed its output channel"))
        except asyncio.CancelledError:
            self._break(ChannelClosedError("the router closed this output channel"))
            with contextlib.suppress(Exception):
                import ray

                ray.cancel(stream)
            raise
        except Exception as exc:
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        self.broken = exc
        for inbox in self._inboxes.values():
            inbox.put_nowait(exc)
        self._inboxes.clear()


class Channels:
    """One channel per worker (by engine id: a restarted actor is a new engine, and gets a
    new channel), opened at its first request."""

    def __init__(self) -> None:
        self._by_worker: dict[str, WorkerChannel] = {}

    def of(self, worker_id: str, handle: Any) -> WorkerChannel:
        channel = self._by_worker.get(worker_id)
        if channel is None or channel.broken is not None:
            channel = self._by_worker[worker_id] = WorkerChannel(handle)
        return channel

    def close(self) -> None:
        for channel in self._by_worker.values():
            channel.stop()
        self._by_worker.clear()
