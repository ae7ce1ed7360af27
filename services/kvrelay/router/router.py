"""The router: validates, admits, fans a request's samples out through the relay, and merges
their news into one stream of chunks, observing the latency metrics on the way.

Stateless between requests apart from load and cache estimates (WorkerRegistry), so several
routers can serve the same pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvrelay.common.block_hash import hash_token_blocks
from kvrelay.common.messages import EngineRequest, Role, samples_of
from kvrelay.common.sampling_params import check_vocab
from kvrelay.config import DEFAULT_MAX_N, RouterConfig
from kvrelay.metrics import RouterMetrics
from kvrelay.router.admission import AdmissionController, Claim, Cost, Ticket
from kvrelay.router.constraints import ConstraintChecker
from kvrelay.router.prompt_encoder import PromptEncoder
from kvrelay.router.relay import Relay, SampleRun
from kvrelay.router.request_errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    RouterError,
    UnavailableError,
)
from kvrelay.router.sample_state import SampleState
from kvrelay.router.tenant_limits import TenantBook, TenantLimitError
from kvrelay.router.types import ChoiceDelta, GenerateChunk, GenerateRequest, Usage
from kvrelay.router.workers import WorkerRegistry

logger = logging.getLogger(__name__)

_DONE = object()  # a sample task's end marker in the merge queue


@dataclass(frozen=True)
class ModelCard:
    """The one model a router serves."""

    id: str
    max_model_len: int
    created: int


class Router:
    def __init__(
        self,
        registry: WorkerRegistry,
        tokenizer: Any,
        model: ModelCard,
        relay: Relay,
        admission: AdmissionController,
        metrics: RouterMetrics,
        max_n: int = DEFAULT_MAX_N,
    ) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.model = model
        self.relay = relay
        self.admission = admission
        self.metrics = metrics
        self.draining = False
        self.max_n = max_n
        # Tenants' limits and weights; the API server replaces it with --tenant-limits' file.
        self.tenants = TenantBook(metrics=metrics.tenants)
        self.encoder = PromptEncoder(tokenizer, model.max_model_len)
        self.constraints = ConstraintChecker(tokenizer, self.encoder.call)
        # Added tokens included; once, not per request. None: served on token ids alone.
        self._vocab_size = len(tokenizer) if tokenizer is not None else None

    @classmethod
    def create(
        cls,
        registry: WorkerRegistry,
        tokenizer: Any,
        model: ModelCard,
        config: RouterConfig | None = None,
        metrics: RouterMetrics | None = None,
        policy: Any = None,
    ) -> Router:
        """A router with its relay and admission, as `config` says. `policy`: a RoutingPolicy
        to use instead of `config.routing_policy`'s."""
        from kvrelay.router.policy import RoutingPolicy

        config = config or RouterConfig()
        metrics = metrics or RouterMetrics()
        metrics.watch_pools(registry.by_pool)
        metrics.watch_workers(model.id, registry.loads)
        policy = policy or RoutingPolicy(config.routing_policy)
        relay = Relay(registry, policy, config, metrics)
        admission = AdmissionController(
            config.max_in_flight, config.max_queued, kv_capacity=registry.decode_token_capacity
        )
        return cls(registry, tokenizer, model, relay, admission, metrics, config.max_n)

    # -- requests --

    def check_model(self, model: str | None) -> None:
        if model and model != self.model.id:
            raise ModelNotFoundError(model, [self.model.id])

    def check_request(self, request: GenerateRequest) -> None:
        """Bad input -> InvalidRequestError naming the field (nothing is admitted yet)."""
        self.check_model(request.model)
        self._check_prompt(request)
        self._check_samples(request)
        if request.params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need the model's tokenizer", "stop")

    async def check_output_constraint(self, request: GenerateRequest) -> None:
        """A structured-output constraint that cannot compile -> InvalidRequestError naming
        its field; call before `admit` (compiled once per constraint, off the event loop)."""
        await self.constraints.check(request)

    def _check_prompt(self, request: GenerateRequest) -> None:
        num_prompt, prompt = len(request.prompt_token_ids), request.param("prompt")
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", prompt)
        limit = self.model.max_model_len
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; this model's context length is {limit} "
                "tokens, prompt and output together: shorten the prompt",
                prompt,
            )
        max_tokens = request.params.max_tokens
        if max_tokens is not None and num_prompt + max_tokens > limit:
            name = request.param("max_tokens")
            raise InvalidRequestError(
                f"{name}={max_tokens} plus the prompt's {num_prompt} tokens exceeds the "
                f"context length {limit}: lower {name}",
                name,
            )
        vocab = self._vocab_size
        if vocab is None:
            return
        bias_name, allowed_name = request.param("logit_bias"), request.param("allowed_token_ids")
        bias_ids = (t for t, _ in request.params.logit_bias)
        allowed_ids = request.params.allowed_token_ids or ()
        for name, ids in (
            (prompt, request.prompt_token_ids),
            (bias_name, bias_ids),
            (allowed_name, allowed_ids),
        ):
            try:
                check_vocab(name, ids, vocab)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), name) from None

    def _check_samples(self, request: GenerateRequest) -> None:
        """n within bounds, and the request's cost within what admission could ever run: a
        request that could never fit is refused now, naming the field, never queued."""
        n, name = request.params.n, request.param("n")
        if n > self.max_n:
            raise InvalidRequestError(f"{name} must be <= {self.max_n}, got {n}", name)
        cost = self.cost(request)
        why = self.admission.never_fits(cost)
        if why == "sequences":
            raise InvalidRequestError(
                f"{name}={n} is more sequences than this server runs at once "
                f"({self.admission.max_in_flight}, --max-in-flight): lower {name}",
                name,
            )
        if why == "kv":
            limit = request.param("max_tokens")
            given = request.params.max_tokens
            each = (
                f"up to {given} tokens"
                if given is not None
                else "no max_tokens (the context length)"
            )
            raise InvalidRequestError(
                f"{name}={n} samples of {each} may hold {cost.kv_tokens} tokens of KV, more than "
                f"this server's KV cache holds ({self.registry.decode_token_capacity()} tokens): "
                f"lower {name} or set/lower {limit}",
                name,
            )

    def cost(self, request: GenerateRequest) -> Cost:
        """What `request` holds while it runs: n sequences, each up to its prompt plus
        max_tokens of KV (the context length when max_tokens is unset)."""
        prompt, limit = len(request.prompt_token_ids), self.model.max_model_len
        max_tokens = request.params.max_tokens
        each = limit if max_tokens is None else min(limit, prompt + max_tokens)
        return Cost(request.params.n, request.params.n * each)

    def admit(self, request: GenerateRequest) -> Ticket:
        """Check the request and reserve its place now: bad input, draining, no workers and
        overload are raised here, so an API answers them with a status before it streams.
        The ticket goes to `generate`; release it if `generate` never runs."""
        self.check_request(request)
        if self.draining:
            raise UnavailableError("the server is shutting down; retry on another replica")
        if not self.is_ready():
            raise UnavailableError("no worker is available to serve requests; retry shortly")
        tenant, limits = request.tenant, self.tenants.limits(request.tenant)
        most, n, name = limits.max_concurrent_sequences, request.params.n, request.param("n")
        if most is not None and n > most:
            raise InvalidRequestError(
                f"{name}={n} is more sequences than this API key may run at once ({most}, "
                f"its max_concurrent_sequences): lower {name}",
                name,
            )
        try:
            self.tenants.check(tenant)
            claim = Claim(tenant, request.priority, limits.weight, limits.max_concurrent_sequences)
            ticket = self.admission.reserve(self.cost(request), claim)
        except OverloadedError as exc:
            if isinstance(exc, TenantLimitError):
                self.tenants.limited(exc)
            self.metrics.requests.labels(self.model.id, "rejected").inc()
            raise
        self.tenants.record(tenant, len(request.prompt_token_ids))
        self.metrics.queued.inc()
        return ticket

    async def generate(
        self, request: GenerateRequest, ticket: Ticket | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a request's chunks; the last carries the usage. Closing the iterator early
        (a cancelled client) aborts the request at its workers. Without a `ticket` from
        `admit`, it is admitted here."""
        if ticket is None:
            ticket = self.admit(request)
        arrival = time.monotonic()
        outcome = "error"
        admitted = False
        try:
            await ticket.wait()
            admitted = True
            self.metrics.queued.dec()
            self.metrics.in_flight.inc()
            self.metrics.queue_time.labels(self.model.id).observe(time.monotonic() - arrival)
            # aclosing: a client that leaves stops the samples' tasks now, not at GC time.
            async with contextlib.aclosing(self._generate(request, arrival)) as chunks:
                async for chunk in chunks:
                    for choice in chunk.choices:
                        if choice.index == 0 and choice.finish_reason is not None:
                            outcome = choice.finish_reason  # stop | length | abort
                    generated = sum(len(choice.token_ids) for choice in chunk.choices)
                    self.tenants.count_tokens(request.tenant, generated)
                    yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "abort"
            raise
        finally:
            ticket.release()
            if admitted:
                self.metrics.in_flight.dec()
            else:
                self.metrics.queued.dec()
            self.metrics.requests.labels(self.model.id, outcome).inc()

    async def _generate(
        self, request: GenerateRequest, arrival: float
    ) -> AsyncGenerator[GenerateChunk, None]:
        runs = self._sample_runs(request)
        queue: asyncio.Queue[object] = asyncio.Queue()
        for run in runs:
            run.emit = queue.put_nowait
        block_size, extra_keys = self._hashing()
        hashes = hash_token_blocks(request.prompt_token_ids, block_size, extra_keys)

        async def run_sample(run: SampleRun) -> None:
            try:
                await self.relay.run(run, hashes, block_size)
            except BaseException as exc:
                queue.put_nowait(exc)
                raise
            finally:
                queue.put_nowait(_DONE)

        tasks = [asyncio.create_task(run_sample(run)) for run in runs]
        timer = _Timer(arrival, admitted=time.monotonic())
        try:
            async with asyncio.timeout(request.timeout_s):
                async for choices in _merge(queue, len(tasks)):
                    timer.tokens(sum(len(c.token_ids) for c in choices if c.index == 0))
                    yield GenerateChunk(request.request_id, choices)
        except TimeoutError as exc:
            raise DeadlineExceededError(
                f"the request's deadline ({request.timeout_s:g} s) passed"
            ) from exc
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
        usage = Usage(
            len(request.prompt_token_ids),
            sum(len(run.state.token_ids) for run in runs),
            runs[0].num_cached_tokens,
        )
        yield GenerateChunk(request.request_id, [], usage)
        self._observe(request, runs[0], timer, usage)

    def _sample_runs(self, request: GenerateRequest) -> list[SampleRun]:
        params = request.params
        runs = []
        weight = self.tenants.limits(request.tenant).weight
        for index, (rid, sample_params) in enumerate(samples_of(request.request_id, params)):
            # Stop strings are matched here, on the text; workers see token ids only. The
            # prompt's logprobs are the same for every sample: sample 0 computes them.
            prompt_logprobs = sample_params.prompt_logprobs if index == 0 else None
            worker_params = dataclasses.replace(
                sample_params, stop=(), prompt_logprobs=prompt_logprobs
            )
            state = SampleState(
                index,
                self.tokenizer,
                params,
                request.prompt_token_ids,
                request.include_stop_str_in_output,
            )
            worker_request = EngineRequest(
                rid,
                request.prompt_token_ids,
                worker_params,
                priority=request.priority,
                tenant=request.tenant,  # the engine shares its batch by tenant and weight
                weight=weight,
            )
            runs.append(SampleRun(worker_request, state, _no_emit))
        return runs

    def _hashing(self) -> tuple[int, tuple[str, ...]]:
        """How the workers that will serve the request hash its blocks: a decode worker of the
        serving revision's (another revision may use another block size or model)."""
        serving = self.registry.healthy(Role.DECODE) or self.registry.healthy(Role.BOTH)
        worker = next(iter(serving or self.registry.workers.values()), None)
        if worker is None:
            raise UnavailableError("no worker is available; retry shortly")
        return worker.info.block_size, worker.info.hash_extra_keys

    def _observe(
        self, request: GenerateRequest, run: SampleRun, timer: _Timer, usage: Usage
    ) -> None:
        model = self.model.id
        m = self.metrics
        m.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        m.generation_tokens.labels(model).inc(usage.completion_tokens)
        now = time.monotonic()
        m.e2e.labels(model).observe(now - timer.arrival)
        if timer.first is not None:
            m.ttft.labels(model).observe(timer.first - timer.arrival)
            m.prefill_time.labels(model).observe(timer.first - timer.admitted)
            m.decode_time.labels(model).observe(now - timer.first)
            for gap in timer.gaps:
                m.itl.labels(model).observe(gap)
        if "prefill_done" in run.times and "first_decode" in run.times:
            m.transfer_time.labels(model).observe(
                run.times["first_decode"] - run.times["prefill_done"]
            )

    # -- lifecycle --

    def start_draining(self) -> None:
        self.draining = True
        self.admission.close()

    @property
    def num_active(self) -> int:
        return self.admission.requests_in_flight + self.admission.requests_queued

    def is_ready(self) -> bool:
        roles = self.registry.roles()
        return not self.draining and (Role.DECODE in roles or Role.BOTH in roles)


class _Timer:
    """TTFT and inter-token gaps of sample 0, as the client sees them."""

    def __init__(self, arrival: float, admitted: float) -> None:
        self.arrival = arrival
        self.admitted = admitted  # out of the admission queue
        self.first: float | None = None
        self.last = arrival
        self.gaps: list[float] = []

    def tokens(self, count: int) -> None:
        if count == 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            count -= 1
        elif count:
            self.gaps.extend([(now - self.last) / count] * count)
        self.last = now


async def _merge(queue: asyncio.Queue[object], num_tasks: int) -> AsyncIterator[list[ChoiceDelta]]:
    """The samples' news as it comes, coalesced per sample when several wait in the queue."""
    remaining = num_tasks
    while remaining:
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        merged: dict[int, ChoiceDelta] = {}
        for item in items:
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            elif isinstance(item, ChoiceDelta):
                if item.index in merged:
                    merged[item.index].merge(item)
                else:
                    merged[item.index] = item
        if merged:
            yield sorted(merged.values(), key=lambda c: c.index)


def _no_emit(delta: ChoiceDelta) -> None:
    raise RuntimeError("SampleRun.emit was not set")


__all__ = ["ModelCard", "Router", "RouterError"]
