"""The engine: `add_request`, `abort`, `step() -> outputs`; one scheduler, one runner, one pool.

A pure library: no Ray, gRPC or Kubernetes. Workers wrap it and drive `step` from a thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.detokenizer import Tokenizer
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager, blocks_needed
from kvrelay.engine.kv_cache.layout import allocate_kv_cache, kv_block_bytes
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.runner import CausalLMModel, ModelRunner, SampledToken
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.sampling import SamplingParams
from kvrelay.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for routing and metrics.

    The prefix-cache fields are cumulative counters (0 with prefix caching off):
    `prefix_cache_queries` counts the tokens of every admitted sequence (prompt, plus output
    when a preempted one is recomputed) and `prefix_cache_hits` those of them found cached, as
    vLLM counts them; `prefix_cache_evictions` counts cached blocks whose content was dropped
    to reuse the block. `num_cached_blocks` is a gauge: blocks holding cached content now.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    num_cached_blocks: int = 0


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
        num_blocks = config.cache.resolve_num_blocks(
            kv_block_bytes(config.model_config, block_size, dtype)
        )
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
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        """Stop a request and free its blocks. Returns its final output, or None if unknown."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child in parent.children:
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
        return parent

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
        )

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
