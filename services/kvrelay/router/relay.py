"""One sample's way through the workers (docs/architecture.md section 2).

Route -> (prefill at P, first token out, KV handle) -> decode at D, which pulls P's blocks ->
release P's lease at D's first output -> stream D's tokens. Or, by the decision, the whole
request on one worker. Every exit path (finish, stop string, cancellation, failure) aborts
the request wherever it still runs, so every KV block is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from kvrelay.common.messages import (
    ChannelItem,
    EngineRequest,
    KVHandle,
    OutputDelta,
    RequestFailedError,
    Role,
)
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.metrics import RouterMetrics
from kvrelay.router.decision import Decision, decide
from kvrelay.router.policy import RouteQuery, RoutingPolicy
from kvrelay.router.request_errors import InvalidRequestError, RouterError, UnavailableError
from kvrelay.router.sample_state import SampleState
from kvrelay.router.types import ChoiceDelta
from kvrelay.router.worker_channels import ChannelClosedError, Channels
from kvrelay.router.workers import WorkerRegistry, WorkerState

logger = logging.getLogger(__name__)


class WorkerLostError(Exception):
    def __init__(self, worker: WorkerState, cause: BaseException) -> None:
        super().__init__(f"worker {worker.worker_id} ({worker.role}) failed: {cause}")
        self.worker = worker


@dataclass
class SampleRun:
    """One sample of a request on its way: what to run and where its news goes."""

    # What the workers run, built once (router.py) and sent whole: its id is the worker-side
    # one (messages.sample_request_id), its params as the worker gets them (n = 1, no stop
    # strings); a hop's KV handle or resume tokens are set on a copy (`for_worker`).
    request: EngineRequest
    state: SampleState
    emit: Callable[[ChoiceDelta], None]
    emitted: bool = False
    num_cached_tokens: int = 0
    decision: Decision | None = None
    times: dict[str, float] = field(default_factory=dict)  # prefill_done, first_decode
    has_prompt_logprobs: bool = False  # taken from a worker already (they come once)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def for_worker(self, kv_handle: KVHandle | None, resume: Sequence[int] = ()) -> EngineRequest:
        """The request as one worker runs it: after `kv_handle`'s prefill, or after the
        `resume` tokens a lost worker produced."""
        if kv_handle is None and not resume:
            return self.request
        params = self.request.params
        if params.prompt_logprobs is not None:  # the prefill (or first) worker sent them
            params = dataclasses.replace(params, prompt_logprobs=None)
        return dataclasses.replace(
            self.request, params=params, kv_handle=kv_handle, resume_output_token_ids=tuple(resume)
        )

    def take(self, delta: OutputDelta) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        prompt_logprobs, delta_prompt = None, delta.prompt_logprobs
        if delta_prompt is not None and not self.has_prompt_logprobs:
            prompt_logprobs, self.has_prompt_logprobs = delta_prompt, True
        for sample in delta.samples:
            news = self.state.feed(sample)
            if prompt_logprobs is not None:  # once, with the first news
                news = news or ChoiceDelta(self.state.index)
                news.prompt_logprobs, prompt_logprobs = prompt_logprobs, None
            if news is not None:
                self.emitted = self.emitted or bool(news.token_ids)
                self.emit(news)


class Relay:
    def __init__(
        self,
        registry: WorkerRegistry,
        policy: RoutingPolicy,
        config: RouterConfig,
        metrics: RouterMetrics,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.config = config
        self.metrics = metrics
        # Each worker's outputs for this router come on one channel (router/worker_channels.py).
        self.channels = Channels()
        self._late_aborts: set[asyncio.Task[None]] = set()  # see _abort_once_started

    async def run(self, run: SampleRun, hashes: Sequence[bytes], block_size: int) -> None:
        """Run the sample to its end. A worker that dies is taken out and the sample goes on
        elsewhere, up to `max_attempts` times: retried whole if it had produced no token yet,
        else migrated: resumed at a decode-capable worker after the tokens it already has, so
        the client's stream goes on with no gap and no repeat."""
        lost_revision: str | None = None  # the revision the sample's tokens came from
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                if run.state.token_ids:
                    await self._migrate(run, hashes, block_size, lost_revision)
                else:
                    if attempt > 1:  # the pools may be down to no decode worker: wait for one
                        await self._decode_capable(RouteQuery(hashes, 0))
                    await self._run_once(run, hashes, block_size)
                return
            except WorkerLostError as exc:
                lost_revision = exc.worker.revision
                self.registry.remove(exc.worker.worker_id, str(exc))
                logger.warning(
                    "request %s (attempt %d of %d): %s",
                    run.request_id,
                    attempt,
                    self.config.max_attempts,
                    exc,
                    exc_info=exc.__cause__,
                )
                if attempt == self.config.max_attempts:
                    self.metrics.migrations.labels("failed").inc()
                    raise UnavailableError(
                        f"the workers serving this request failed {attempt} times; retry it"
                    ) from exc

    async def _migrate(
        self, run: SampleRun, hashes: Sequence[bytes], block_size: int, revision: str | None
    ) -> None:
        """Resume the sample at a healthy decode-capable worker of `revision` (the lost
        worker's: the same model and engine made its tokens so far) after those tokens,
        waiting (up to `migration_wait_s`) for one to exist: a pool of one is being replaced."""
        done = run.state.token_ids
        blocks_needed = -(-(len(run.prompt) + (run.params.max_tokens or len(done))) // block_size)
        worker = await self._decode_capable(RouteQuery(hashes, blocks_needed), revision)
        self.metrics.migrations.labels("resumed").inc()
        self.registry.index.record(worker.worker_id, hashes)
        await self._stream(run, worker, None, resume=list(done))

    async def _decode_capable(self, query: RouteQuery, revision: str | None = None) -> WorkerState:
        """A healthy decode-capable worker for `query` of `revision` (default: the serving
        one), waiting up to `migration_wait_s` for one to exist (a worker just lost; its
        replacement is starting)."""
        deadline = time.monotonic() + self.config.migration_wait_s
        while True:
            candidates = [
                *self.registry.healthy(Role.DECODE, revision),
                *self.registry.healthy(Role.BOTH, revision),
            ]
            worker = self.policy.pick(candidates, query, self.registry.index)
            if worker is not None:
                return worker
            if time.monotonic() >= deadline:
                self.metrics.migrations.labels("failed").inc()
                raise UnavailableError(
                    "the worker serving this request failed and no other could take it over "
                    f"within {self.config.migration_wait_s:g} s; retry it"
                )
            await asyncio.sleep(0.2)

    async def _run_once(self, run: SampleRun, hashes: Sequence[bytes], block_size: int) -> None:
        roles = self.registry.roles()
        blocks_needed = -(-(len(run.prompt) + (run.params.max_tokens or 0)) // block_size)
        query = RouteQuery(hashes, blocks_needed)
        index = self.registry.index
        decoder = self.policy.pick(self.registry.healthy(Role.DECODE), query, index)
        cached = index.matched_blocks(decoder.worker_id, hashes) * block_size if decoder else 0
        run.decision = decide(len(run.prompt), cached, roles, self.config.max_local_prefill_tokens)
        self.metrics.decisions.labels(run.decision.value).inc()
        if run.decision is Decision.COLOCATED:
            worker = self.policy.pick(self.registry.healthy(Role.BOTH), query, index)
            assert worker is not None
            index.record(worker.worker_id, hashes)
            await self._stream(run, worker, None)
            return
        assert decoder is not None
        if run.decision is Decision.DECODE_ONLY:
            index.record(decoder.worker_id, hashes)
            await self._stream(run, decoder, None)
            return
        prefiller = self.policy.pick(self.registry.healthy(Role.PREFILL), query, index)
        assert prefiller is not None
        index.record(prefiller.worker_id, hashes)
        await self._disaggregated(run, prefiller, decoder, hashes)

    async def _disaggregated(
        self, run: SampleRun, prefill: WorkerState, decode: WorkerState, hashes: Sequence[bytes]
    ) -> None:
        first = await self._prefill(run, prefill, decode.worker_id)
        run.times["prefill_done"] = time.monotonic()
        run.take(first)
        kv_handle = first.kv_handle
        if kv_handle is None or run.state.finished:
            if kv_handle is not None:  # a stop string matched the first token
                _fire(prefill.actor.release_kv, run.request_id)
            return
        # The decode worker holds the prompt once it pulls it, not before: recorded at the
        # pick, a sample running alongside (n > 1) or a retry after the prefill worker died
        # would count the prompt as cached there and prefill it whole on the decode worker.
        self.registry.index.record(decode.worker_id, hashes)
        lease_held: bool | None = None

        async def release() -> bool:
            nonlocal lease_held
            lease_held = await _release(prefill, run.request_id)
            return lease_held is not False

        try:
            completed = await self._stream(run, decode, kv_handle, before_first=release)
        finally:
            if lease_held is None:  # never reached the decode's first output
                _fire(prefill.actor.release_kv, run.request_id)
        if not completed:
            await self._lease_lost(run, decode, kv_handle)

    async def _prefill(self, run: SampleRun, worker: WorkerState, decode_id: str) -> OutputDelta:
        """The prompt prefilled at `worker`; its KV handle is bound to the decode engine
        `decode_id` (no other engine may pull it)."""
        worker.in_flight += 1
        done = False
        try:
            first: OutputDelta = await worker.actor.prefill.remote(run.request, decode_id)
            done = True
            return first
        except (RayActorError, ActorUnavailableError) as exc:
            raise WorkerLostError(worker, exc) from exc
        except RayTaskError as exc:
            raise _task_error(exc) from exc
        finally:
            worker.in_flight -= 1
            if not done:
                _fire(worker.actor.abort, run.request_id)  # cancelled: frees a lease too

    async def _lease_lost(self, run: SampleRun, decode: WorkerState, kv_handle: KVHandle) -> None:
        """The prefill lease ended before the pull did: the pulled blocks may hold another
        request's KV. Drop them from the decode worker's cache, then recompute or fail."""
        self.metrics.leases_lost.inc()
        try:
            await decode.actor.forget_kv.remote(kv_handle)
        except (RayActorError, ActorUnavailableError) as exc:
            raise WorkerLostError(decode, exc) from exc
        reason = f"request {run.request_id}: the prefill KV lease expired before the pull ended"
        if self.config.kv_transfer_failure == "fail":
            raise UnavailableError(f"KV transfer failed: {reason}; retry the request")
        logger.warning("%s; recomputing on the decode worker", reason)
        # Greedy and seeded samples recompute the same tokens; positions line the streams up.
        await self._stream(run, decode, None)

    async def _stream(
        self,
        run: SampleRun,
        worker: WorkerState,
        kv_handle: KVHandle | None,
        before_first: Callable[[], Any] | None = None,
        resume: Sequence[int] = (),
    ) -> bool:
        """Stream the sample from `worker` until it finishes (after the `resume` tokens it
        already has, when given); False when `before_first` (run at the first output, before
        it is used) says to stop."""
        worker.in_flight += 1
        worker_done = False
        channel = self.channels.of(worker.worker_id, worker.actor)
        tag, inbox = channel.open()
        start = worker.actor.start.remote(
            channel.channel_id, tag, run.for_worker(kv_handle, resume)
        )
        started = False
        try:
            await start
            started = True
            while True:
                delta = _delta_of(await inbox.get())
                worker_done = delta.finished
                if before_first is not None:
                    run.times["first_decode"] = time.monotonic()
                    keep_going = await before_first()
                    before_first = None
                    if not keep_going:
                        # Awaited, not fired: Ray does not order an async actor's calls, and
                        # a late abort would kill the recompute that follows on this worker.
                        worker_done = True
                        await worker.actor.abort.remote(run.request_id)
                        return False
                run.take(delta)
                if worker_done or run.state.finished:
                    return True
                if not inbox.empty():
                    # A batch brought several steps at once: let the client's writer send
                    # this one first (one chunk per step, as a stream per request gave),
                    # or the router's merge would coalesce them.
                    await asyncio.sleep(0)
        except (RayActorError, ActorUnavailableError, ChannelClosedError) as exc:
            worker_done = True
            raise WorkerLostError(worker, exc) from exc
        except RayTaskError as exc:
            worker_done = True
            raise _task_error(exc) from exc
        except RouterError:
            worker_done = True  # the worker ended the stream with a failure
            raise
        finally:
            channel.close(tag)
            worker.in_flight -= 1
            if not worker_done and started:  # a stop string, a cancelled client
                _fire(worker.actor.abort, run.request_id)
            elif not worker_done:
                self._abort_once_started(worker, run.request_id, start)

    def _abort_once_started(self, worker: WorkerState, request_id: str, start: Any) -> None:
        """Abort a request whose `start` call has not answered yet (the client left while it
        was on its way), once it has: an abort that ran at the worker before the request
        was added there would find nothing, and the request would run on to its end."""

        async def abort_after_start() -> None:
            with contextlib.suppress(Exception):
                await start
            _fire(worker.actor.abort, request_id)

        task = asyncio.get_running_loop().create_task(abort_after_start())
        self._late_aborts.add(task)
        task.add_done_callback(self._late_aborts.discard)


def _delta_of(item: ChannelItem | BaseException) -> OutputDelta:
    """A channel item's delta; its failure (or the channel's) raised."""
    if isinstance(item, BaseException):
        raise item
    if item.delta is not None:
        return item.delta
    if item.error_kind == "failed":
        raise RouterError(item.error)
    if item.error_kind == "invalid":
        raise InvalidRequestError(item.error)
    logger.error("a worker failed a request: %s", item.error)
    raise RouterError("a worker failed this request; it has been logged")


async def _release(prefill: WorkerState, request_id: str) -> bool | None:
    """Release the prefill lease: whether it was still held; None if P is unreachable (a dead
    worker cannot reuse the blocks either)."""
    try:
        held: bool = await prefill.actor.release_kv.remote(request_id)
        return held
    except Exception:
        logger.warning(
            "request %s: could not release its prefill KV lease", request_id, exc_info=True
        )
        return None


def _fire(method: Any, *args: Any) -> None:
    """Call an actor method without waiting (abort / release on the way out)."""
    try:
        method.remote(*args)
    except Exception:
        name = getattr(method, "_method_name", method)
        logger.warning("could not call %s on a worker", name, exc_info=True)


def _task_error(exc: RayTaskError) -> RouterError:
    """What the client hears of a worker's failure: our own words (a refusal, or the engine
    failing that one request), never an exception's repr with the worker's internals."""
    cause = exc.cause
    if isinstance(cause, RequestFailedError):
        return RouterError(str(cause))
    if isinstance(cause, ValueError):
        return InvalidRequestError(str(cause))
    logger.error("a worker failed a request: %r", cause)
    return RouterError("a worker failed this request; it has been logged")
