"""EngineLoop: one thread drives an Engine; asyncio callers send it commands and await outputs.

The Engine is not thread-safe: only the loop thread touches it. Commands (add, abort,
finish_pull, any `call`) queue up and run between steps; with nothing to run the thread
blocks on the queue. Decode-side KV pulls run on a small thread pool, never on the loop thread,
and report back with a `finish_pull` command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from kvrelay.common.messages import EngineRequest, KVHandle, PullPlan, RequestFailedError
from kvrelay.engine.engine import Engine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.transfer.base import KVConnector, TransferError
from kvrelay.worker.core_share import StepThreads
from kvrelay.worker.heap_trim import HeapTrimmer
from kvrelay_kernels.cpu_threads import use_one_cpu_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")
Command = Callable[[], None]
# A request's next item: its cumulative output, or (int) the next token of its one sample
# when that is all a step brought (the engine's StepDelta rows), or why it ended.
_Item = RequestOutput | int | BaseException


class _Stream:
    """One request's outputs, handed from the loop thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()

    def put(self, item: _Item) -> None:
        _deliver(self.loop, [(self, item)])


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, _Item]]) -> None:
    """Hand `items` to their streams on `loop` with ONE wake-up of it (a step's outputs for
    all the requests one event loop waits on, not one call_soon_threadsafe per request)."""

    def put_all() -> None:
        for stream, item in items:
            stream.queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:
        # The caller's loop is closed: nobody is listening.
        logger.debug("output dropped: its caller's event loop is closed", exc_info=True)


class EngineLoop:
    """Owns `engine` (and its thread) from construction until `shutdown`."""

    def __init__(
        self,
        engine: Engine,
        connector: KVConnector | None = None,
        *,
        idle_wait_s: float = 0.2,
        pull_threads: int = 2,
        heap_trimmer: HeapTrimmer | None = None,
        step_threads: StepThreads | None = None,
    ) -> None:
        """`heap_trimmer`: gives freed heap memory back when the engine goes idle
        (worker/heap_trim.py); a worker that owns its process passes one. `step_threads`:
        sizes each step's OpenMP team to the cores the worker's partners leave idle
        (worker/core_share.py); None: the engine's threads for every step."""
        self.engine = engine
        self.heap_trimmer = heap_trimmer
        self.step_threads = step_threads
        self.connector = connector
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        # Pulls copy into the cache beside the steps: one CPU thread each (cpu_threads.py).
        self._pulls = concurrent.futures.ThreadPoolExecutor(
            max_workers=pull_threads, thread_name_prefix="kv-pull", initializer=use_one_cpu_thread
        )
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread; the async ones from an event loop) --

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, command: Command) -> None:
        if self._stopping:
            raise RuntimeError("the engine loop is shut down")
        self._commands.put(command)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the loop thread, between steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)

        self.submit(command)
        return await asyncio.wrap_future(future)

    async def outputs(self, request: EngineRequest) -> AsyncIterator[RequestOutput | int]:
        """Add `request` (`Engine.add`; a prefilled one's KV pulled from its `kv_handle`'s
        worker) and yield what each step brought it up to its finished output: its cumulative
        output, or, where a step brought only one more token of its one sample, that token
        id (an int: the engine's `StepDelta` rows, never the first item nor the last).
        Leaving early aborts it."""
        stream = _Stream(asyncio.get_running_loop())
        self.submit(lambda: self._add(request, stream))
        request_id = request.request_id
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the loop has dropped it already
                    raise item
                finished = not isinstance(item, int) and item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and not self._stopping:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (a held lease too); its stream gets the final
        output."""
        self.submit(lambda: self._abort(request_id))

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=30)
        self._pulls.shutdown(wait=False, cancel_futures=True)

    # -- the loop thread's side --

    def _add(self, request: EngineRequest, stream: _Stream) -> None:
        if request.request_id in self._streams:
            stream.put(ValueError(f"request {request.request_id!r} is already running here"))
            return
        try:
            plan = self.engine.add(request)
        except Exception as exc:
            stream.put(exc)
            return
        self._streams[request.request_id] = stream
        if request.kv_handle is not None and plan is not None:
            self._pulls.submit(self._pull, request.kv_handle, plan)

    def _pull(self, handle: KVHandle, plan: PullPlan) -> None:
        """On a pull thread: fetch the blocks, then let the loop thread finish the pull."""
        ok = False
        try:
            if self.connector is None:
                raise TransferError("this worker has no KV connector")
            self.connector.pull(handle, plan)
            ok = True
        except TransferError as exc:
            logger.warning("request %s: KV pull failed: %s", plan.request_id, exc, exc_info=True)
        except Exception:
            logger.exception("request %s: KV pull failed", plan.request_id)
        if not self._stopping:
            # A failed request's final output comes from the next step (engine.has_work).
            self.submit(lambda: self.engine.finish_pull(plan.request_id, ok))

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(output if output is not None else RuntimeError(f"{request_id} aborted"))

    def _run(self) -> None:
        idle_steps = 0
        while True:
            if self.engine.has_work():
                # Waiting requests that cannot be scheduled now: back off a little.
                timeout: float | None = 0.005 if idle_steps else None
            else:
                timeout = self.idle_wait_s
            if not self._drain(timeout):
                break
            if self.engine.has_work():
                if self.step_threads is not None:
                    self.step_threads.before_step()
                idle_steps = 0 if self._step() else idle_steps + 1
                if self.step_threads is not None and not self.engine.has_work():
                    self.step_threads.idle()  # now, not after the idle wait: a partner may borrow
                if self.heap_trimmer is not None:
                    self.heap_trimmer.worked()  # trims only after a long busy stretch
            else:
                idle_steps = 0
                self.engine.expire_leases()
                if self.heap_trimmer is not None:
                    self.heap_trimmer.idle()  # nothing waits: a trim delays no step
        for stream in self._streams.values():
            stream.put(RuntimeError("the engine loop is shut down"))
        self._streams.clear()
        if self.step_threads is not None:
            self.step_threads.close()

    def _drain(self, timeout: float | None) -> bool:
        """Run queued commands, first waiting up to `timeout` (None: not at all) for one.
        False once shutdown is asked."""
        try:
            if timeout:
                command = self._commands.get(timeout=timeout)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            try:
                command()
            except Exception:
                logger.exception("engine loop command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> bool:
        """One engine step, outputs delivered; False when nothing could run (back off).

        A request the engine failed alone ends its stream with RequestFailedError; a step
        that raises (the engine's state is then unknown) fails every request here."""
        try:
            request_ids, token_ids, outputs = self.engine.step_delta()
        except Exception as exc:
            logger.exception("engine step failed; failing every request here")
            for request_id, failed in list(self._streams.items()):
                try:
                    self.engine.abort(request_id)
                except Exception:  # the same fault may strike again: free what we can
                    logger.exception("request %s: abort after a failed step failed", request_id)
                failed.put(exc)
            self._streams.clear()
            return False
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Item]]] = {}
        streams = self._streams
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            stream = streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, token_id))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            # A request the engine failed alone (its blocks are freed already): its caller
            # gets the error, the other requests of the step their tokens.
            item = output if output.error is None else RequestFailedError(output.error)
            by_loop.setdefault(stream.loop, []).append((stream, item))
            if output.finished:
                del self._streams[output.request_id]
        for loop, items in by_loop.items():
            _deliver(loop, items)
        # A prefill chunk yields no output but is progress: only an empty running set (waiting
        # requests that do not fit yet) is a reason to back off.
        return bool(outputs) or bool(request_ids) or bool(self.engine.scheduler.running)
