"""A user's request as the caller sees it: `n` sampled sequences, their text, one output.

The scheduler only knows sequences (`Request`); this fans a request out into them, groups them
back and detokenizes. It never schedules or frees anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.common.detokenizer import IncrementalDetokenizer, Tokenizer
from kvrelay.common.messages import KVHandle, PromptLogprob, samples_of
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.engine.request import FINISH_REASONS, Request, RequestStatus


@dataclass
class ParentRequest:
    """The `n` sequences of one request and what they produced so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)
    kv_handle: KVHandle | None = None  # set when a prefill engine hands the request off
    error: str | None = None  # set when the engine failed the request (RequestOutput.error)
    # One sample without text, logprobs or prompt logprobs: `output` takes the short way.
    _plain: bool = field(init=False, repr=False)
    # Plain, and an output of it handed over already: a step may hand over only its new
    # token from now on (outputs.StepDelta's rows); its caller has the rest.
    delta_ready: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.children[0].sampling_params if self.children else None
        self._plain = (
            params is not None
            and len(self.children) == 1
            and self.detokenizers in ([], [None])
            and params.logprobs is None
            and params.prompt_logprobs is None
        )

    @classmethod
    def fan_out(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        tokenizer: Tokenizer | None,
        max_total_tokens: int,
        eos_token_ids: tuple[int, ...],
        priority: int = 0,
    ) -> ParentRequest:
        """A request's `params.n` samples, each a request of its own as the one fan-out rule
        (`kvrelay.common.messages.samples_of`, the router's too) names and sets it up."""
        children = []
        for sample_id, sample_params in samples_of(request_id, params):
            generator = None
            if sample_params.seed is not None:
                generator = torch.Generator().manual_seed(sample_params.seed)
            children.append(
                Request(
                    request_id=sample_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=sample_params,
                    max_total_tokens=max_total_tokens,
                    eos_token_ids=eos_token_ids,
                    priority=priority,
                    generator=generator,
                )
            )
        detoks: list[IncrementalDetokenizer | None] = [
            IncrementalDetokenizer(
                tokenizer, params.skip_special_tokens, params.stop, prompt_token_ids
            )
            if tokenizer is not None
            else None
            for _ in children
        ]
        return cls(request_id, prompt, prompt_token_ids, children, detoks)

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:  # every step, for every running request: no generator
            return children[0].is_finished
        return all(child.is_finished for child in children)

    def detokenize(self, index: int, token_id: int) -> str | None:
        """Feed sample `index`'s new token to its detokenizer; returns a matched stop string."""
        detok = self.detokenizers[index]
        if detok is None:
            return None
        _, stop = detok.add(token_id)
        return stop

    def output(self) -> RequestOutput:
        """The cumulative output of every sample so far. Built for every running request
        every step, so it reads each sample's state once and makes nothing it can skip."""
        if self._plain:
            self.delta_ready = True
            return self._plain_output()
        completions = [
            self._completion(index, child, self.detokenizers[index])
            for index, child in enumerate(self.children)
        ]
        return RequestOutput(  # positional (RequestOutput's field order): a third cheaper
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.finished,
            self.metrics(),
            self.kv_handle,
            self.error,
            self._prompt_logprobs(),
        )

    def _plain_output(self) -> RequestOutput:
        """`output` of one sample without text or logprobs: what most running requests of a
        served batch are (every argument positional, the metrics built inline)."""
        child = self.children[0]
        status = child.status
        metrics = {
            "arrival_time": child.arrival_time,
            "num_cached_tokens": float(child.num_cached_tokens),
        }
        if child.first_token_time is not None:
            metrics["first_token_time"] = child.first_token_time
        completion = CompletionOutput(
            0,
            "",
            child.output_token_ids[:],
            None,
            None,
            FINISH_REASONS.get(status),
            child.stop_reason,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            status > RequestStatus.PREEMPTED,
            metrics,
            self.kv_handle,
            self.error,
            None,
        )

    def _prompt_logprobs(self) -> list[PromptLogprob] | None:
        """Every prompt token's entry once all are scored (by whichever sample prefilled)."""
        if self.children[0].sampling_params.prompt_logprobs is None:
            return None
        scored = max((child.prompt_logprobs for child in self.children), key=len)
        return scored if len(scored) == len(self.prompt_token_ids) - 1 else None

    @staticmethod
    def _completion(
        index: int, child: Request, detok: IncrementalDetokenizer | None
    ) -> CompletionOutput:
        if child.sampling_params.logprobs is None:
            logprobs, cumulative = None, None
        else:
            # A resumed sequence's first tokens have no logprobs here (its caller has them).
            logprobs, cumulative = child.output_logprobs, child.cumulative_logprob
        return CompletionOutput(
            index,
            detok.text if detok is not None else "",
            child.output_token_ids[:],
            logprobs,
            cumulative,
            child.status.finish_reason,
            child.stop_reason,
        )

    def metrics(self) -> dict[str, float]:
        """Timestamps (time.monotonic() seconds) and cache use so far; see RequestOutput."""
        children = self.children
        if len(children) == 1:  # every step, for every running request: the short way
            only = children[0]
            metrics = {
                "arrival_time": only.arrival_time,
                "num_cached_tokens": float(only.num_cached_tokens),
            }
            if only.first_token_time is not None:
                metrics["first_token_time"] = only.first_token_time
            return metrics
        metrics = {
            "arrival_time": min(child.arrival_time for child in children),
            "num_cached_tokens": float(children[0].num_cached_tokens),
        }
        first = [c.first_token_time for c in children if c.first_token_time is not None]
        if first:
            metrics["first_token_time"] = min(first)
        return metrics
