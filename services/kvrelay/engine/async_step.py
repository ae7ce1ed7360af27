"""Async scheduling (vLLM's `--async-scheduling`, SGLang's overlap scheduler): step n+1 is
launched before step n's sampled tokens are read, so on a GPU the host's work on step n (the
token read, appends, stop checks, outputs) and its scheduling of step n+1 run while the
device computes.

How: a request whose token of step n is still on the device counts it as known
(`Request.num_pending`), so the scheduler gives it its next decode; its input id for step
n+1 is gathered on the device from step n's sampled-token tensor (`Feed`); step n's tokens
go to pinned host memory by a `non_blocking` copy and an event, read when step n+1 is
launched. A request that step n's token stops (EOS, stop string, max_tokens, an abort) has
its step-(n+1) row discarded (never appended, never emitted); blocks a launched step uses go
back to the pool only once that step is done (`in_use` / `hold`; a preemption waits instead).

Steps that need the host between two steps run synchronously, the in-flight step read
first: a request with penalties, logprobs, prompt logprobs or a grammar
(`Request.host_bound`), samples about to fork (n > 1 with prefix caching). min_tokens
overlaps: its mask counts the token in flight as generated (SamplingRow.num_pending).
Unseeded random rows draw from the engine's shared generator, which a discarded row also
draws from: their tokens are samples as good as the synchronous engine's, not the same draws
(seeded rows are: a discarded row's generator is never used again). It schedules, launches
and reads; what a token means for its request stays the engine's (engine.py,
step_outputs.py).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.request import LaunchMark, Request
from kvrelay.engine.runner import Feed, FeedEveryRow, ModelRunner, StepResult
from kvrelay.engine.scheduled import SchedulerOutput
from kvrelay.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)
_REQUEST = operator.itemgetter(0)  # a ScheduledChunk's request

# engine._execute: the plan run with the feed, sampled tokens left on the device; aborts
# the batch and raises when the forward pass fails.
Execute = Callable[[SchedulerOutput, Feed], StepResult]


def async_enabled(config: EngineConfig) -> bool:
    """Whether the engine overlaps its steps: `config.async_scheduling`, or by default on
    CUDA (on the CPU torch runs each op on the calling thread: nothing to overlap).

    Raises:
        ValueError: async scheduling asked for on a prefill engine.
    """
    asked = config.async_scheduling
    if config.role == "prefill":
        if asked:
            raise ValueError(
                "async_scheduling cannot run on a prefill engine (it hands each request off "
                "at its first token, read at once): drop --async-scheduling or use role both"
            )
        if config.device.startswith("cuda"):
            logger.info("async scheduling off: a prefill engine reads each first token at once")
        return False
    return config.device.startswith("cuda") if asked is None else asked


def overlap_for(config: EngineConfig, scheduler: Scheduler, runner: ModelRunner) -> Overlap | None:
    """The engine's overlapped step loop, or None when async scheduling is off."""
    if not async_enabled(config):
        return None
    return Overlap(scheduler, runner, config.model_config.vocab_size)


class InFlight(NamedTuple):
    """A launched step whose sampled tokens are not read yet."""

    number: int  # steps launched so far, this one included
    chunks: list[Any]  # its ScheduledChunks
    result: StepResult  # its sampled requests (and their tokens, when already read)
    tokens: torch.Tensor  # [len(requests)] int64 on the device: the next step's inputs
    host: torch.Tensor | None  # their host copy (pinned on CUDA); None when already read
    event: Any  # torch.cuda.Event recorded after the copy; None on the CPU
    # A steady decode batch (the step before's sampled requests, in the same order): each
    # one's pending token of that step stands for this one's, so neither the launch counted
    # nor the read of that step uncounts it (`Request.num_pending`, per row).
    took_over: bool = False


class Overlap:
    """One engine's overlapped step loop, and the fence on the blocks its launched steps use
    (block_fence.BlockFence)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.vocab_size = vocab_size
        self.device = runner.device
        self.launched = 0  # steps launched
        self.done = 0  # steps whose device work is known to be done
        self.inflight: InFlight | None = None
        self._held: list[tuple[int, list[int]]] = []  # (last step using them, blocks)
        self._buffers: list[torch.Tensor | None] = [None, None]  # host copies, by parity
        self._events: list[Any] = [None, None]  # each buffer's copy's event
        # `running` and `waiting` when each was last found free of host-bound requests.
        self._checked: list[list[Request]] = [[], []]
        self._updates: SchedulerOutput | None = None  # launched; counted computed after the read
        # The requests of the last launch's chunks, in order, and the mark they share.
        self._marked: list[Request] = []
        self._mark = LaunchMark(0)
        scheduler.fence = self

    # -- the fence on freed blocks (block_fence.BlockFence) --

    def in_use(self, request: Request) -> bool:
        return request.launch_mark.number > self.done

    def hold(self, request: Request, blocks: list[int]) -> None:
        if blocks:
            self._held.append((request.launch_mark.number, blocks))

    def wait(self) -> None:
        flight = self.inflight
        if flight is not None and flight.event is not None:
            flight.event.synchronize()
        self._completed(self.launched)

    def _completed(self, number: int) -> None:
        """Steps up to `number` are done on the device: the blocks held for them go back."""
        self.done = max(self.done, number)
        if self._held:
            pool = self.scheduler.kv_cache.pool
            keep = []
            for last, blocks in self._held:
                if last <= self.done:
                    pool.free(blocks)
                else:
                    keep.append((last, blocks))
            self._held = keep

    # -- the step loop --

    def step(self, execute: Execute, abort: Callable[[Request], None]) -> StepResult | None:
        """Schedule and launch the next step, then read the one in flight: its result is
        what the engine appends now (empty at the first step). None: this step must run
        synchronously and nothing is in flight (the engine runs it as without overlap)."""
        previous = self.inflight
        if not self._can_launch():
            if previous is None:
                return None
            self.inflight = None
            return self._read(previous)  # the next step then runs synchronously
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            try:
                self.inflight = self._launch(plan, previous, execute)
            except Exception:
                self._abandon(previous, abort)
                raise
        else:
            self.inflight = None
        if previous is None:
            return StepResult.empty()
        launched = self.inflight
        return self._read(previous, handed_on=launched is not None and launched.took_over)

    def after_outputs(self) -> None:
        """The read step's tokens are appended: the launched step's chunks now count as
        computed (their blocks' hashes need those tokens); with nothing left to run, the
        launched step is waited for, so that every block is back in the pool."""
        plan, self._updates = self._updates, None
        if plan is not None:
            self.scheduler.update_after_step(plan.chunks, decodes_only=plan.decodes_only)
        if self.inflight is not None and not self.scheduler.num_unfinished:
            self.drain()

    def drain(self) -> None:
        """Wait for the step in flight and drop it: every request of it is finished."""
        flight, self.inflight = self.inflight, None
        if flight is not None:
            self._read(flight)

    def _can_launch(self) -> bool:
        """Whether the next step may be launched before the last one is read: no request
        that needs the host between steps (Request.host_bound), no samples about to fork."""
        scheduler = self.scheduler
        if scheduler.forking:
            return False
        for index, requests in enumerate((scheduler.running, scheduler.waiting)):
            # By identity, in C: a steady batch (and queue) costs one list compare a step.
            if requests != self._checked[index]:
                if any(r.host_bound for r in requests):
                    return False
                self._checked[index] = requests[:]
        return True

    def _launch(
        self, plan: SchedulerOutput, previous: InFlight | None, execute: Execute
    ) -> InFlight:
        number = self.launched = self.launched + 1
        requests = list(map(_REQUEST, plan.chunks))
        self._mark_launched(requests, number)
        # A steady decode batch: the requests `previous` sampled, in the same order (compared
        # by identity, in C), each one token. Its inputs come from `previous`'s tokens in one
        # device op, and it takes their pending counts over (InFlight.took_over).
        feed: Feed
        if previous is not None and plan.decodes_only and requests == previous.result.requests:
            took_over, feed = True, FeedEveryRow(previous.tokens)
        else:
            took_over, feed = False, self._feed(plan, previous)
        result = execute(plan, feed)
        self._updates = plan
        if not took_over:  # else each one's pending token carries over
            for request in result.requests:
                request.num_pending += 1
        tokens = result.device_tokens
        top = self.vocab_size - 1
        if tokens is None:  # sampled at once (a failed batch, isolation.py): read already
            ids = np.clip(np.array(result.token_ids, np.int64), 0, top)  # a failed row's -1
            tokens = torch.from_numpy(ids).to(self.device, non_blocking=True)
            return InFlight(number, plan.chunks, result, tokens, None, None, took_over)
        host, event = self._copy_to_host(tokens, number)
        # After the copy, in stream order: the read sees a token outside the vocabulary (a
        # row whose sampling gave none fails its request), the next step's embedding never.
        with torch.inference_mode():  # made under it (runner.py): changed under it
            tokens.clamp_(0, top)
        return InFlight(number, plan.chunks, result, tokens, host, event, took_over)

    def _mark_launched(self, requests: list[Request], number: int) -> None:
        """`requests`' blocks are in use until step `number` is done. The same requests as the
        last launch's (compared by identity, in C: a steady batch) share its mark: bumped."""
        if requests == self._marked:
            self._mark.number = number
            return
        mark = self._mark = LaunchMark(number)
        for request in requests:
            request.launch_mark = mark
        self._marked = requests

    def _feed(self, plan: SchedulerOutput, previous: InFlight | None) -> Feed:
        """Writes each decode's input id whose token `previous` sampled (not read yet) from
        its device tensor (clamped into the vocabulary: `_launch`), row by row (a steady
        batch takes FeedEveryRow instead)."""
        if previous is None:
            return _no_feed
        requests = previous.result.requests
        source = previous.tokens
        chunks = plan.chunks
        row_of = dict(zip(requests, range(len(requests)), strict=True))
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for request, _, size, _, _ in chunks:
            if request.num_pending:
                dst.append(offset)
                src.append(row_of[request])
            offset += size
        if not dst:
            return _no_feed
        index = torch.from_numpy(np.array([dst, src], np.int64))
        index = index.to(self.device, non_blocking=True)  # [2, k]: one copy

        def feed(input_ids: torch.Tensor) -> None:
            # input_ids: [T] int64; the rows `index[0]` take tokens `index[1]` of `source`
            input_ids.index_copy_(0, index[0], source.index_select(0, index[1]))

        return feed

    def _copy_to_host(self, tokens: torch.Tensor, number: int) -> tuple[torch.Tensor, Any]:
        """`tokens` [S] copied to host memory without waiting, and the event after the copy
        (None on the CPU: computed already). Two pinned buffers, by the step's
        parity: the one a step writes was last read two steps before."""
        if tokens.device.type == "cpu":
            return tokens.clone(), None  # `tokens` is clamped next: the read sees them raw
        n = int(tokens.shape[0])
        buffer = self._buffers[number % 2]
        if buffer is None or buffer.shape[0] < n:
            size = max(64, 1 << (n - 1).bit_length())
            buffer = torch.empty(size, dtype=torch.int64, pin_memory=tokens.is_cuda)
            self._buffers[number % 2] = buffer
        host = buffer[:n]
        host.copy_(tokens, non_blocking=True)
        event = self._events[number % 2]
        if event is None:
            event = self._events[number % 2] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tokens.device))
        return host, event

    def _read(self, flight: InFlight, handed_on: bool = False) -> StepResult:
        """`flight`'s tokens on the host (the step's one wait), its requests' pending token
        taken back unless `handed_on` (the step launched after it took them over); a token
        outside the vocabulary fails its request alone (as sampler._check_token_ids makes
        the synchronous step do)."""
        result = flight.result
        if flight.host is not None:
            if flight.event is not None:
                flight.event.synchronize()
            ids = self.runner.sampler.read_tokens(flight.host)
            vocab = self.vocab_size
            failed = []
            if ids and not (min(ids) >= 0 and max(ids) < vocab):
                pairs = zip(result.requests, ids, strict=True)
                failed = [r for r, t in pairs if not 0 <= t < vocab]
                logger.warning("%d sampled token(s) outside the vocabulary", len(failed))
            result = StepResult(result.requests, ids, [None] * len(ids), failed)
        if not handed_on:
            for request in result.requests:
                request.num_pending -= 1
        self._completed(flight.number)
        return result

    def _abandon(self, previous: InFlight | None, abort: Callable[[Request], None]) -> None:
        """The launch failed (its batch aborted by `execute`): the step in flight is waited
        for and its requests aborted too (their tokens are never read)."""
        self.inflight = None
        self._updates = None
        if previous is not None:
            self._read(previous)
            for request in previous.result.requests:
                if not request.is_finished:
                    abort(request)
        self.wait()


def _no_feed(input_ids: torch.Tensor) -> None:
    """No row's input is on the device: the step still leaves its tokens there."""
