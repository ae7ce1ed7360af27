"""The router's end of the workers' output channels (worker/channel.py).

One long-lived Ray streaming call per worker carries, per batch, the deltas of every request
this router runs there; a pump demultiplexes them by tag into per-stream inboxes. A request is
started with a plain `start` call. When the channel breaks (the worker died), every stream on
it gets the error, so each one migrates or retries as it would have when its own stream broke;
the next request opens a fresh channel.

The pump is a thread per channel that blocks in `ray.wait` and `ray.get`, and hands each batch
to the event loop in one callback. Awaiting the stream's objects on the loop instead cost the
router ~2x the CPU per batch (each `await` of a Ray object is a callback registered on Ray's IO
thread and a wake-up crossing back, twice per object in Ray's async generator): at one stream
that was ~0.7 ms of a ~25 ms decode step on two shared cores, taken from the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from kvrelay.messages import ChannelItem

logger = logging.getLogger(__name__)

Inbox = asyncio.Queue[ChannelItem | BaseException]
T = TypeVar("T")

# How often a pump looks up from an idle wait to see whether it was stopped (stopping also
# cancels the stream, which ends the wait at once; this bounds a missed wake-up).
PUMP_WAKE_S = 0.5


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
        self._stream = handle.channel.options(num_returns="streaming").remote(self.channel_id)
        self._loop = asyncio.get_running_loop()
        self._stopping = threading.Event()
        name = f"kvrelay-channel-{self.channel_id[:8]}"
        self._pump = threading.Thread(target=self._run, name=name, daemon=True)
        self._pump.start()

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
        """End the channel: its streams get ChannelClosedError, the worker aborts them."""
        self._stopping.set()
        self._break(ChannelClosedError("the router closed this output channel"))
        with contextlib.suppress(Exception):
            import ray

            ray.cancel(self._stream)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the pump thread to end (after `stop`)."""
        self._pump.join(timeout_s)

    @property
    def streams(self) -> int:
        return len(self._inboxes)

    def _run(self) -> None:
        """The pump thread: every batch, in order, to `_deliver` on the loop."""
        import ray

        error: BaseException = ChannelClosedError("the router closed this output channel")
        try:
            while not self._stopping.is_set():
                ready, _ = ray.wait([self._stream], timeout=PUMP_WAKE_S)
                if not ready:
                    continue
                ref = next(self._stream, None)
                if ref is None:
                    error = ChannelClosedError("the worker closed its output channel")
                    break
                self._to_loop(self._deliver, ray.get(ref))
        except Exception as exc:  # the worker died, or the stream was cancelled by stop()
            if not self._stopping.is_set():
                error = exc
        self._to_loop(self._break, error)

    def _to_loop(self, callback: Callable[[T], None], arg: T) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens now
            self._loop.call_soon_threadsafe(callback, arg)

    def _deliver(self, batch: list[ChannelItem]) -> None:
        for item in batch:
            inbox = self._inboxes.get(item.tag)
            if inbox is not None:
                inbox.put_nowait(item)

    def _break(self, exc: BaseException) -> None:
        if self.broken is not None:  # stop() got there first
            return
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
        """Stop every channel, and wait (briefly) for the pumps to leave Ray, so that a Ray
        shutdown right after never meets one inside `ray.get`."""
        channels = list(self._by_worker.values())
        self._by_worker.clear()
        for channel in channels:
            channel.stop()
        deadline = time.monotonic() + 2 * PUMP_WAKE_S
        for channel in channels:
            channel.join(max(0.0, deadline - time.monotonic()))
