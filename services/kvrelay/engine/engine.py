"""The engine core: `add`, `abort`, `step() -> outputs` (scheduler -> runner -> sampler).
A pure library: no Ray, gRPC or Kubernetes imports, and no P/D hand-off logic (handoff.py)."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Sequence

import torch

from kvrelay.common.detokenizer import Tokenizer
from kvrelay.common.messages import EngineRequest, EngineStats, KVHandle, PullPlan, Role
from kvrelay.common.sampling_params import SamplingParams, check_vocab
from kvrelay.config import EngineConfig
from kvrelay.engine.async_step import overlap_for
from kvrelay.engine.engine_stats import engine_stats
from kvrelay.engine.grammar_gate import GrammarGate, advance_matcher
from kvrelay.engine.handoff import KVHandoff, first_token_logprobs
from kvrelay.engine.isolation import SAMPLING_FAILED
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.kv_cache.layout import allocate_kv_cache, kv_block_bytes
from kvrelay.engine.outputs import RequestOutput, StepDelta
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.prompt_logprobs import take_scores
from kvrelay.engine.request import Request, RequestStatus, validate_prompt
from kvrelay.engine.resume import check_resume, resume
from kvrelay.engine.runner import CausalLMModel, Feed, ModelRunner, StepResult
from kvrelay.engine.sampler import Sampler, skip_seeded_draws
from kvrelay.engine.scheduled import SchedulerOutput
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.step_outputs import Rows, SteadyRows, append_sampled
from kvrelay.engine.warm_up import warm_up
from kvrelay_kernels import jit_watch

logger = logging.getLogger(__name__)

# How long a step with nothing to run but grammars compiling waits for one (no busy loop).
GRAMMAR_IDLE_WAIT_S = 0.005


class Engine:
    """Continuous-batching inference over a paged KV cache."""

    def __init__(
        self, config: EngineConfig, model: CausalLMModel, tokenizer: Tokenizer | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = getattr(torch, config.dtype)
        block_size = config.cache.block_size
        self.kv_block_bytes = kv_block_bytes(config.model_config, block_size, dtype)
        num_blocks = config.cache.resolve_num_blocks(self.kv_block_bytes)
        self.kv_cache = KVCacheManager(
            num_blocks,
            block_size,
            enable_caching=config.cache.enable_prefix_caching,
            extra_keys=(config.model,),
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        kv_tensor = allocate_kv_cache(
            config.model_config, num_blocks, block_size, dtype, device=config.device
        )
        self.max_total_tokens = min(config.max_model_len, num_blocks * block_size)
        self.runner = ModelRunner(
            model,
            kv_tensor,
            block_size,
            Sampler(torch.Generator().manual_seed(config.seed)),
            max_blocks_per_seq=-(-self.max_total_tokens // block_size),
            max_num_seqs=config.scheduler.max_num_seqs,
        )
        if config.device.startswith("cuda"):
            self._warm_up(kv_tensor)
        self.overlap = overlap_for(config, self.scheduler, self.runner)  # async scheduling
        self.role = Role(config.role)
        self.handoff = KVHandoff(
            self.kv_cache,
            self.scheduler,
            role=self.role,
            engine_id=config.engine_id or uuid.uuid4().hex[:12],
            # Nanoseconds since the epoch at start: a restarted engine always has a larger one.
            epoch=time.time_ns(),
            kv_block_bytes=self.kv_block_bytes,
            lease_seconds=config.kv_lease_seconds,
            failure_policy=config.kv_transfer_failure,
            kv_device=kv_tensor.device,  # the fence waits on this device's KV writes
        )
        self._parents: dict[str, ParentRequest] = {}
        self._owner: dict[str, tuple[ParentRequest, int]] = {}
        self._steady_rows = SteadyRows()  # a steady batch's tokens appended in C
        # Requests finished outside a step (a failed hand-off, a stop at the handed-off first
        # token): the next `step` returns their final outputs.
        self._finished_outside_step: dict[str, ParentRequest] = {}
        self._prompt_tokens = self._generation_tokens = 0
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%.0f MiB), max_model_len %d",
            num_blocks,
            block_size,
            kv_tensor.numel() * kv_tensor.element_size() / 2**20,
            config.max_model_len,
        )

    @functools.cached_property
    def _grammar(self) -> GrammarGate:
        """Structured outputs: requests held while their grammar compiles (grammar_gate.py)."""
        return GrammarGate.of_engine(self.config, self.tokenizer)

    def _warm_up(self, kv_tensor: torch.Tensor) -> None:
        """Every kernel variant a step can launch, compiled before the engine is ready (a
        compile while serving stalls a step: warm_up.py), then the decode graphs captured."""
        jit_watch.install()
        with jit_watch.warming_up():
            warm_up(self.runner.model, kv_tensor, self.runner.sampler)
            if not self.config.enforce_eager:
                self.runner.capture_cuda_graphs(
                    self.config.scheduler.max_num_seqs, self.max_total_tokens
                )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.pool.num_blocks

    @property
    def kv_tensor(self) -> torch.Tensor:
        """The block-major KV tensor (what a KV connector registers and reads or writes)."""
        return self.runner.kv_cache

    @property
    def engine_id(self) -> str:
        return self.handoff.engine_id

    @property
    def epoch(self) -> int:
        return self.handoff.epoch

    def add(self, request: EngineRequest) -> PullPlan | None:
        """Queue a request, taken whole; its `params.n` samples run as separate sequences.

        With a `kv_handle` (decode role), its prompt was prefilled by another engine: blocks
        for the prompt are allocated here (prefix-cache hits reused) and the caller pulls the
        handle's blocks into them by the returned plan, then calls `finish_pull`. The plan is
        None when no pull is needed or possible (the first token ended it, no KV room now, or
        a handle that does not match the prompt): the request then recomputes its prompt
        here, or under kv_transfer_failure="fail" is finished with its final output returned
        by the next `step`; the caller should just release the prefill lease.

        `resume_output_token_ids` (n = 1 only) continues a sequence another engine started:
        those outputs are recomputed with the prompt and count as this request's own (for
        max_tokens, min_tokens, penalties), and a seeded generator skips their draws, so the
        tokens that follow are the ones the first engine would have produced.

        With prefix caching on, the samples share one prefill: sample 0 computes the prompt,
        the others fork from it at its first token (copy-on-write of the partial last block).
        With it off, each sample computes the prompt itself.

        Raises:
            ValueError: a duplicate id, an empty prompt, a token (or a logit_bias id)
                outside the vocabulary, a prompt that does not fit the context length or
                the KV cache, n > 1 on a prefill engine, or with a `kv_handle`: n > 1,
                resume tokens, or a prefill engine.
        """
        if request.kv_handle is not None:
            return self._add_prefilled(request, request.kv_handle)
        self.handoff.check_params(request.params, prefilled=False)
        resumed = check_resume(request, self.config.model_config.vocab_size, self.max_total_tokens)
        children = self._register(request)
        if resumed:
            resume(children[0], resumed, *self._owner[children[0].request_id])
        if request.params.structured_outputs is not None:
            self._grammar.hold(self._parents[request.request_id], queued=True)
        else:
            self._queue(children)
        return None

    def _queue(self, children: list[Request]) -> None:
        if self.kv_cache.enable_caching:
            self.scheduler.add(children[0], forks=children[1:])
        else:
            for child in children:
                self.scheduler.add(child)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        resume_output_token_ids: Sequence[int] = (),
    ) -> None:
        """`add` of a new request, by its fields (the offline API's and the tests' form)."""
        self.add(
            EngineRequest(
                request_id,
                prompt_token_ids,
                params,
                resume_output_token_ids=resume_output_token_ids,
                prompt=prompt,
                priority=priority,
            )
        )

    def _register(self, request: EngineRequest) -> list[Request]:
        """Validate a new request and create its `n` samples (not queued yet)."""
        request_id, params = request.request_id, request.params
        if request_id in self._parents or self.handoff.has_lease(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.config.model_config.vocab_size
        prompt_ids = validate_prompt(
            request.prompt_token_ids,
            vocab_size=vocab,
            max_model_len=self.config.max_model_len,
            kv_capacity=self.num_blocks * self.kv_cache.block_size,
        )
        check_vocab("logit_bias", (token for token, _ in params.logit_bias), vocab)
        check_vocab("allowed_token_ids", params.allowed_token_ids or (), vocab)
        parent = ParentRequest.fan_out(
            request_id,
            request.prompt,
            prompt_ids,
            params,
            tokenizer=self.tokenizer,
            max_total_tokens=self.max_total_tokens,
            eos_token_ids=self.config.model_config.eos_token_ids,
            priority=request.priority,
        )
        self._prompt_tokens += len(prompt_ids)
        self._parents[request_id] = parent
        for index, child in enumerate(parent.children):
            self._owner[child.request_id] = (parent, index)
            child.tenant, child.weight = request.tenant, request.weight  # its samples share it
        return parent.children

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks (a held lease too). Returns its final output, or
        None if unknown (or only leased)."""
        self.handoff.cancel(request_id)
        self._grammar.discard(request_id)
        self._finished_outside_step.pop(request_id, None)
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self._owner.pop(child.request_id, None)
        if self.overlap is not None and not self.scheduler.num_unfinished:
            self.overlap.drain()  # nothing left but the rows of finished requests
        return parent.output()

    def has_unfinished_requests(self) -> bool:
        """Whether any request has not yet had its final output returned."""
        return bool(self._parents)

    def has_work(self) -> bool:
        """Whether `step` would do something now: requests to run, or outputs to return.
        (Requests waiting for remote KV need a `finish_pull` first.)"""
        scheduler = self.scheduler
        in_flight = self.overlap is not None and self.overlap.inflight is not None
        return bool(
            scheduler.running
            or scheduler.waiting
            or self._finished_outside_step
            or self._grammar
            or in_flight
        )

    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule, forward, sample, update.

        A request whose sampling fails (its parameters break the sampler's arithmetic) fails
        alone: its final output carries `error`, its blocks are freed, and the rest of the
        batch goes on with the very tokens it would have had without it.

        Returns:
            The cumulative output of every request that produced a token or finished, the
            final outputs of requests finished since the last step outside it included.

        Raises:
            Exception: the forward pass failed; every request of the batch is aborted first
                (not bisected: a forward failure is rarely one request's doing, since prompts
                are validated on entry, and re-running a part of a batch that has written
                into copy-on-write blocks is not safe).
        """
        return self._step(None).outputs

    def step_delta(self) -> StepDelta:
        """`step`, handing over only what is new (what a server streams): a running plain
        request's next token as a row of two lists, not its cumulative output rebuilt; the
        rest as `step` gives it (outputs.StepDelta). Mixing the two on one engine is fine: a
        row always follows an output of its request handed over by either."""
        return self._step(([], []))

    def _step(self, rows: Rows | None) -> StepDelta:
        self.handoff.expire_leases()
        if self._grammar:
            self._release_compiled()
        overlap = self.overlap
        result = None if overlap is None else overlap.step(self._execute, self._abort_sample)
        if result is None:  # a synchronous step
            plan = self.scheduler.schedule()
            result = self._execute(plan) if not plan.is_empty else StepResult.empty()
        touched, self._finished_outside_step = self._finished_outside_step, {}
        take_scores(result.prompt_scores)
        for request in result.failed:
            parent = self._fail(request, SAMPLING_FAILED)
            touched[parent.request_id] = parent
        # Requests failed above (or a sibling of theirs) are finished: skipped there.
        sampled, appended = append_sampled(
            *result[:3],
            self._owner,
            slow=self._append_token,
            finish=self.scheduler.finish,
            fast=self.role is not Role.PREFILL,  # a prefill engine leases each one's KV
            rows=rows,
            steady=self._steady_rows,
        )
        self._generation_tokens += appended
        touched.update(sampled)
        outputs = [parent.output() for parent in touched.values()]
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        if self.overlap is not None:
            self.overlap.after_outputs()
        return StepDelta(*(rows or ([], [])), outputs)

    def _release_compiled(self) -> None:
        """Requests whose grammar compiled since the last step go on (or fail alone)."""
        scheduler = self.scheduler
        if not (scheduler.running or scheduler.waiting or self._finished_outside_step):
            self._grammar.wait(GRAMMAR_IDLE_WAIT_S)
        for parent in self._grammar.release(scheduler, self.handoff, self._queue, self.finish_pull):
            self._finished_outside_step[parent.request_id] = parent

    def _execute(self, plan: SchedulerOutput, feed: Feed | None = None) -> StepResult:
        """Run `plan`; with `feed` (async_step.py) its tokens stay on the device and its
        chunks are counted computed later, by the overlap."""
        kv_cache, runner = self.kv_cache, self.runner
        changed, appended = kv_cache.take_changed()  # every step: the tables stay exact
        try:
            if plan.decodes_only and runner.replays_decodes(len(plan.chunks)):
                result = runner.execute_decodes(
                    plan.chunks, kv_cache.block_table, changed, plan.copies, feed, appended
                )
            else:
                tables = [kv_cache.block_table(c.request.request_id) for c in plan.chunks]
                result = runner.execute(plan.chunks, tables, plan.copies, feed)
        except Exception:
            # Free what this batch holds so a failure never leaks blocks, then let it surface
            # (each parent once: aborting one of n samples ends its siblings too).
            owners = [self._owner.get(c.request.request_id) for c in plan.chunks]
            for parent_id in dict.fromkeys(o[0].request_id for o in owners if o is not None):
                self.abort(parent_id)
            raise
        if feed is None:
            self.scheduler.update_after_step(plan.chunks, decodes_only=plan.decodes_only)
        return result

    def _abort_sample(self, request: Request) -> None:
        self.abort(self._owner[request.request_id][0].request_id)

    def _fail(self, request: Request, error: str) -> ParentRequest:
        """Fail `request`'s whole parent (a request's n samples succeed or fail together):
        every unfinished sample aborted and its blocks freed; `error` goes to the client."""
        parent, _ = self._owner[request.request_id]
        parent.error = error
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        return parent

    def _append_token(
        self, request: Request, token_id: int, logprobs: dict[int, float] | None
    ) -> ParentRequest:
        request.append_output(token_id, logprobs)
        self._generation_tokens += 1
        parent, index = self._owner[request.request_id]
        stop_string = parent.detokenize(index, token_id)
        status = request.check_stop()
        if status is None and request.matcher is not None:
            verdict = advance_matcher(request.matcher, token_id)
            if isinstance(verdict, str):  # refused: should not happen under its mask
                return self._fail(request, verdict)
            status = verdict  # the grammar complete: it stops here, as at EOS
        if status is None and stop_string is not None:
            request.stop_reason = stop_string
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(request, status)
        elif self.role is Role.PREFILL:  # only a prefill engine hands requests off
            handle = self.handoff.lease_prompt_kv(request)
            if handle is not None:
                parent.kv_handle = handle  # a decode engine goes on from here
        return parent

    def _forget(self, request_id: str) -> None:
        """A request whose final output was returned: no longer this engine's."""
        for child in self._parents.pop(request_id).children:
            self._owner.pop(child.request_id, None)

    # -- the prefill -> decode hand-off (handoff.py) --

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        handle: KVHandle,
        *,
        prompt: str | None = None,
        priority: int = 0,
    ) -> PullPlan | None:
        """`add` of a request prefilled at `handle`'s engine, by its fields (the tests' form)."""
        request = EngineRequest(
            request_id, prompt_token_ids, params, handle, prompt=prompt, priority=priority
        )
        return self.add(request)

    def _add_prefilled(self, request: EngineRequest, handle: KVHandle) -> PullPlan | None:
        """Decode role: `add` of a request whose prompt another engine prefilled."""
        params = request.params
        if request.resume_output_token_ids:
            raise ValueError("a prefilled request cannot resume after output tokens")
        self.handoff.check_params(params, prefilled=True)
        [child] = self._register(request)
        parent = self._append_token(
            child, handle.first_token_id, first_token_logprobs(handle, params)
        )
        if child.generator is not None and not params.is_greedy:
            skip_seeded_draws(child.generator, 1)  # the prefill engine drew the first token
        plan = None if child.is_finished else self.handoff.admit_prefilled(child, handle)
        if params.structured_outputs is not None and not child.is_finished:
            # Held until its grammar compiles: a recompute queued it (no plan): not yet.
            queued = child.status is RequestStatus.WAITING
            if queued:
                self.scheduler.waiting.remove(child)
            self._grammar.hold(parent, queued=queued)
        if child.is_finished:
            self._finished_outside_step[request.request_id] = parent
        return plan

    def finish_pull(self, request_id: str, ok: bool) -> None:
        """Decode role: the pull of `request_id`'s plan is over. On success it joins the
        running batch; on failure it recomputes its prompt here (counted, logged), or under
        kv_transfer_failure="fail" is finished, its final output returned by the next `step`.
        While its grammar compiles, this is applied once it is compiled."""
        if self._grammar.defer_pull(request_id, ok):
            return
        request = self.handoff.finish_pull(request_id, ok)
        if request is not None and request.is_finished:
            self._finished_outside_step[request_id] = self._owner[request_id][0]

    def release_kv(self, request_id: str) -> bool:
        """Prefill role: free a leased request's blocks (its decode engine has pulled them).

        Returns:
            False when no lease was held (already released, expired, or never granted).
        """
        return self.handoff.release(request_id)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the blocks of every lease past its time; returns their request ids."""
        return self.handoff.expire_leases(now)

    def stats(self) -> EngineStats:
        return engine_stats(
            self.scheduler,
            self.kv_cache,
            self.handoff,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )

    def cached_block_hashes(self) -> list[bytes]:
        """Chain hashes of the full blocks this engine holds in its prefix cache: what a
        router's cache-aware index learns from each worker (block_hash.py)."""
        return self.kv_cache.pool.cached_hashes()

    def forget_cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Drop these hashes from the prefix cache (content that may be wrong, e.g. pulled
        from a lease that ended early), so no later lookup hits them. Returns how many were
        cached. Requests using those blocks keep them."""
        return sum(self.kv_cache.pool.uncache(block_hash) for block_hash in block_hashes)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights are loaded).

        Returns:
            False, and nothing changed, while any request holds blocks; True otherwise.
        """
        return self.kv_cache.reset_prefix_cache()
