"""The engine: `add_request`, `abort`, `step() -> outputs`; one scheduler, one runner, one pool.

A pure library: no Ray, gRPC or Kubernetes. Workers wrap it and drive `step` from a thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.detokenizer import Tokenizer
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager, blocks_needed
from kvrelay.engine.kv_cache.layout import allocate_kv_cache, kv_block_bytes
from kvrelay.engine.leases import LeaseTable
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.runner import CausalLMModel, ModelRunner, SampledToken
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.sampling import SamplingParams
from kvrelay.engine.scheduler import Scheduler
from kvrelay.messages import EngineStats, KVHandle, PullPlan

logger = logging.getLogger(__name__)


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
        sampler = Sampler(torch.Generator().manual_seed(config.seed))
        kv_tensor = allocate_kv_cache(config.model_config, num_blocks, block_size, dtype)
        self.runner = ModelRunner(model, kv_tensor, block_size, sampler)
        self.max_total_tokens = min(config.max_model_len, num_blocks * block_size)
        self._parents: dict[str, ParentRequest] = {}
        self._owner: dict[str, tuple[ParentRequest, int]] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.role = config.role
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        # Nanoseconds since the epoch at start: a restarted engine always has a larger one.
        self.epoch = time.time_ns()
        self._leases = LeaseTable()
        self._pulling: dict[str, tuple[Request, KVHandle, int]] = {}  # + blocks to pull
        self._kv_bytes_pulled = 0
        self._pull_fallbacks = 0
        self._transfer_failures = 0
        # Outputs of requests failed outside `step` (no batch emits them): the caller takes
        # them with `pop_failed_outputs`.
        self._failed_outputs: list[RequestOutput] = []
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%.0f MiB), max_model_len %d",
            num_blocks,
            block_size,
            kv_tensor.numel() * kv_tensor.element_size() / 2**20,
            config.max_model_len,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.pool.num_blocks

    @property
    def kv_tensor(self) -> torch.Tensor:
        """The block-major KV tensor (what a KV connector registers and reads or writes)."""
        return self.runner.kv_cache

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; its `params.n` samples run as separate sequences.

        With prefix caching on, the samples share one prefill: sample 0 computes the prompt,
        the others fork from it at its first token (copy-on-write of the partial last block).
        With it off, each sample computes the prompt itself.

        Raises:
            ValueError: a duplicate id, an empty prompt, a token outside the vocabulary, or a
                prompt that does not fit the context length or the KV cache.
        """
        if request_id in self._parents or request_id in self._leases:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.role == "prefill" and params.n != 1:
            raise ValueError("a prefill engine takes n = 1; run n > 1 colocated")
        prompt_ids = self._validate_prompt(prompt_token_ids)
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                max_total_tokens=self.max_total_tokens,
                eos_token_ids=self.config.model_config.eos_token_ids,
                priority=priority,
                generator=_sample_generator(params, index),
            )
            for index in range(params.n)
        ]
        parent = ParentRequest.create(request_id, prompt, children, self.tokenizer)
        self._prompt_tokens += len(prompt_ids)
        self._parents[request_id] = parent
        for index, child in enumerate(children):
            self._owner[child.request_id] = (parent, index)
        if self.kv_cache.enable_caching:
            self.scheduler.add(children[0], forks=children[1:])
        else:
            for child in children:
                self.scheduler.add(child)

    def _validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {limit}: it must leave "
                "room for at least one generated token; shorten the prompt or raise max_model_len"
            )
        if blocks_needed(len(ids) + 1, self.kv_cache.block_size) > self.num_blocks:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the KV cache holds only "
                f"{self.num_blocks * self.kv_cache.block_size}; raise num_blocks / kv_cache_memory"
            )
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks (a held lease too). Returns its final output, or
        None if unknown (or only leased)."""
        self.release_kv(request_id)
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child in parent.children:
            self._pulling.pop(child.request_id, None)
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self._owner.pop(child.request_id, None)
        return parent.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule, forward, sample, update.

        Returns:
            The cumulative output of every request that produced a token or finished.
        """
        self.expire_leases()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        tables = [self.kv_cache.block_table(c.request.request_id) for c in plan.chunks]
        try:
            sampled = self.runner.execute(plan.chunks, tables, plan.copies)
        except Exception:
            # Free what this batch holds so a failure never leaks blocks, then let it surface.
            for chunk in plan.chunks:
                self.abort(self._owner[chunk.request.request_id][0].request_id)
            raise
        self.scheduler.update_after_step(plan.chunks)
        touched: dict[str, ParentRequest] = {}
        for request, token in sampled:
            parent = self._append_token(request, token)
            touched[parent.request_id] = parent
        return [self._emit(parent) for parent in touched.values()]

    def _append_token(self, request: Request, token: SampledToken) -> ParentRequest:
        logprobs = None
        if token.logprobs is not None:
            logprobs = dict(token.logprobs.top)
            logprobs[token.token_id] = token.logprobs.token_logprob
        request.append_output(token.token_id, logprobs)
        self._generation_tokens += 1
        parent, index = self._owner[request.request_id]
        stop_string = parent.detokenize(index, token.token_id)
        status = request.check_stop()
        if status is None and stop_string is not None:
            request.stop_reason = stop_string
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(request, status)
        elif self.role == "prefill":
            self._hand_off(request, parent)
        return parent

    def _hand_off(self, request: Request, parent: ParentRequest) -> None:
        """Prefill role: the first token is out; hold the prompt's blocks for a decode engine."""
        rid = request.request_id
        self.scheduler.detach(request)
        request.status = RequestStatus.FINISHED_REMOTE
        num_tokens = request.num_prompt_tokens
        table = self.kv_cache.block_table(rid)[
            : blocks_needed(num_tokens, self.kv_cache.block_size)
        ]
        hashes = self.kv_cache.block_hashes(request, num_tokens // self.kv_cache.block_size)
        parent.kv_handle = KVHandle(
            engine_id=self.engine_id,
            epoch=self.epoch,
            request_id=rid,
            block_ids=tuple(table),
            num_tokens=num_tokens,
            block_hashes=tuple(hashes),
            first_token_id=request.output_token_ids[0],
            first_token_logprobs=(
                tuple(request.output_logprobs[0].items()) if request.output_logprobs else None
            ),
        )
        self._leases.grant(rid, time.monotonic() + self.config.kv_lease_seconds)

    def release_kv(self, request_id: str) -> bool:
        """Prefill role: free a leased request's blocks (its decode engine has pulled them).

        Returns:
            False when no lease was held (already released, expired, or never granted).
        """
        if not self._leases.release(request_id):
            return False
        self.kv_cache.free(request_id)
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the blocks of every lease past its time; returns their request ids."""
        expired = self._leases.pop_expired(time.monotonic() if now is None else now)
        for request_id in expired:
            logger.warning(
                "request %s: KV lease expired before a decode engine pulled it", request_id
            )
            self.kv_cache.free(request_id)
        return expired

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
        """Decode role: continue a request whose prompt was prefilled by another engine.

        Blocks for the prompt are allocated here (prefix-cache hits reused); the caller pulls
        `handle`'s blocks into them by the returned plan, then calls `finish_pull`.

        Returns:
            The pull plan; or None when no pull is needed or possible (no KV room now, or a
            handle that does not match the prompt): the request then recomputes its prompt
            here, and the caller should just release the prefill lease.

        Raises:
            ValueError: as `add_request`, or `n` > 1.
        """
        if params.n != 1:
            raise ValueError("a prefilled request takes n = 1")
        self.add_request(request_id, prompt_token_ids, params, prompt=prompt, priority=priority)
        parent = self._parents[request_id]
        request = parent.children[0]
        self.scheduler.waiting.remove(request)  # it joins through finish_pull, or below
        # The first token's logprobs travel with the handle, so logprobs stay one per token.
        first_logprobs = None
        if params.logprobs is not None:
            first_logprobs = dict(handle.first_token_logprobs or {handle.first_token_id: 0.0})
        request.append_output(handle.first_token_id, first_logprobs)
        self._generation_tokens += 1
        parent.detokenize(0, handle.first_token_id)
        if (status := request.check_stop()) is not None:
            self.scheduler.finish(request, status)  # nothing left to decode
            return None
        reason = self._handle_mismatch(request, handle)
        cached = [] if reason else self.kv_cache.find_cached_prefix(request)
        if reason is None and not self.kv_cache.allocate_slots(
            request_id, handle.num_tokens, cached_blocks=cached
        ):
            reason = "no free KV blocks"
        if reason is not None:
            self._fall_back(request, reason)
            return None
        request.status = RequestStatus.WAITING_FOR_KV
        table = self.kv_cache.block_table(request_id)
        skip = len(cached)
        self._pulling[request_id] = (request, handle, len(table) - skip)
        return PullPlan(request_id, handle.block_ids[skip:], tuple(table[skip:]))

    def _handle_mismatch(self, request: Request, handle: KVHandle) -> str | None:
        """Why `handle` cannot hold this request's prompt KV, or None when it can."""
        num_tokens = request.num_prompt_tokens
        if handle.num_tokens != num_tokens:
            return f"handle holds {handle.num_tokens} tokens, the prompt has {num_tokens}"
        if len(handle.block_ids) != blocks_needed(num_tokens, self.kv_cache.block_size):
            return f"handle has {len(handle.block_ids)} blocks for {num_tokens} tokens"
        expected = self.kv_cache.block_hashes(request, num_tokens // self.kv_cache.block_size)
        if tuple(expected) != handle.block_hashes:
            return "block hashes differ (another model, or other tokens)"
        return None

    def finish_pull(self, request_id: str, ok: bool) -> None:
        """Decode role: the pull of `request_id`'s plan is over. On success it joins the
        running batch; on failure it recomputes its prompt here (counted, logged)."""
        entry = self._pulling.pop(request_id, None)
        if entry is None:
            return  # aborted meanwhile
        request, handle, num_pulled = entry
        if not ok:
            self.kv_cache.free(request_id)
            self._fall_back(request, "the KV transfer failed")
            return
        self._kv_bytes_pulled += num_pulled * self.kv_block_bytes
        request.num_computed_tokens = handle.num_tokens
        self.kv_cache.cache_full_blocks(request)
        self.scheduler.admit_running(request)

    def _fall_back(self, request: Request, reason: str) -> None:
        if self.config.kv_transfer_failure == "fail":
            self._fail_transfer(request, reason)
            return
        logger.warning("request %s: recomputing its prompt: %s", request.request_id, reason)
        self._pull_fallbacks += 1
        request.num_computed_tokens = 0
        self.scheduler.add(request)

    def _fail_transfer(self, request: Request, reason: str) -> None:
        """kv_transfer_failure="fail": finish the request aborted, with why in stop_reason,
        rather than spend prefill compute here; its output waits in `pop_failed_outputs`."""
        logger.warning("request %s: KV transfer failed, failing it: %s", request.request_id, reason)
        self._transfer_failures += 1
        request.stop_reason = (
            f"KV transfer failed: {reason}; retry, or set kv_transfer_failure=recompute"
        )
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)  # frees every block
        parent, _ = self._owner[request.request_id]
        self._failed_outputs.append(self._emit(parent))

    def pop_failed_outputs(self) -> list[RequestOutput]:
        """The final outputs of requests failed by kv_transfer_failure="fail" since the last
        call (`add_prefilled_request` and `finish_pull` emit nothing themselves)."""
        failed, self._failed_outputs = self._failed_outputs, []
        return failed

    def _emit(self, parent: ParentRequest) -> RequestOutput:
        output = parent.output()
        if output.finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._owner.pop(child.request_id, None)
        return output

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_blocks=self.num_blocks,
            kv_usage=self.kv_cache.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_queries=self.kv_cache.stats.queries,
            prefix_cache_hits=self.kv_cache.stats.hits,
            prefix_cache_evictions=self.kv_cache.pool.num_evictions,
            num_cached_blocks=self.kv_cache.pool.num_cached_blocks,
            num_leases=len(self._leases),
            num_pulling=len(self._pulling),
            kv_leases_expired=self._leases.num_expired,
            kv_pull_fallbacks=self._pull_fallbacks,
            kv_transfer_failures=self._transfer_failures,
            kv_bytes_pulled=self._kv_bytes_pulled,
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


def _sample_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """Sample `index` of a seeded request draws from seed + index: each sample is what a
    separate request with that seed would give."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed + index)
