"""One sequence's state as it moves through the engine: waiting, running, preempted, finished;
and what a prompt must satisfy to become one. It never schedules or allocates anything.

A request with `n` > 1 is run as `n` sequences (see `Engine.add_request`); each is a `Request`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.common.messages import PromptLogprob
from kvrelay.common.sampling_params import SamplingParams, check_vocab

_arrival_counter = itertools.count()


class LaunchMark:
    """The number of the last launched step (async scheduling) that uses the blocks of the
    requests holding this mark. The requests of a launched batch share one; while the batch
    stays the same, each launch bumps its number instead of writing every request."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = 0
    # Decode role: its prompt's blocks are being pulled from a prefill engine (vLLM's name).
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 5  # max_tokens or the context length reached
    FINISHED_ABORTED = 6  # cancelled by the caller
    FINISHED_REMOTE = 7  # prefill role: first token out, blocks handed to a decode engine

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason of a finished status, else None."""
        return FINISH_REASONS.get(self)


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """A sequence to generate: its prompt, what it produced so far, and how much is cached."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Largest number of tokens (prompt + output) this sequence may reach.
    max_total_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first, as in vLLM
    # Whose request it is ("" = the default tenant) and that tenant's weight: the scheduler
    # shares its batch across tenants by running sequences / weight (engine/fair_share.py).
    # The samples of one request share them.
    tenant: str = ""
    weight: float = 1.0
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    # Structured outputs: this sample's llguidance matcher, advanced by each token appended
    # (None without a constraint, and while its grammar compiles). Kept across preemption:
    # the tokens it has read are kept too.
    matcher: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    # Top-n logprobs per output token, when sampling_params.logprobs is set.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Sum of the sampled tokens' logprobs (kept as they come: summing the list every step
    # would cost O(length) per token).
    cumulative_logprob: float = 0.0
    # Tokens whose K/V are in the cache; reset to 0 by preemption (recompute).
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Tie-breaker that keeps FCFS order stable for equal arrival times.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    # Chain hashes of the full blocks of prompt + output hashed so far (common/block_hash.py);
    # tokens never change, so this only grows.
    block_hashes: list[bytes] = field(default_factory=list)
    # Tokens found in the prefix cache at the last admission.
    num_cached_tokens: int = 0
    # time.monotonic() when the first output token was appended.
    first_token_time: float | None = None
    # With sampling_params.prompt_logprobs: entries for prompt tokens 1, 2, ... scored so far
    # (engine/prompt_logprobs.py).
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # Async scheduling (engine/async_step.py): tokens sampled on the device and not yet read
    # (0 or 1 between steps: the scheduler counts them as known, the runner feeds them from
    # the device), and the mark holding the number of the last launched step that uses this
    # sequence's blocks.
    num_pending: int = 0
    launch_mark: LaunchMark = field(default_factory=lambda: LaunchMark(0))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens `start:end` of prompt + output, without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @functools.cached_property
    def scheduling_key(self) -> tuple[int, float, int]:
        """Order of service: priority, then arrival (first come, first served). Kept: the
        scheduler sorts every running request by it every step, and none of its parts
        changes once the request exists."""
        return (self.priority, self.arrival_time, self.arrival_seq)

    @functools.cached_property
    def stop_watch(self) -> tuple[frozenset[int], int]:
        """What `check_stop` can only answer non-None for: a last token in the first set (the
        EOS ids unless ignore_eos, and stop_token_ids), or at least the second number of
        output tokens (max_tokens, or the context length). The engine tests these two before
        calling `check_stop`, so a step of 256 decodes makes no call for most of them. Kept:
        the params, the EOS ids and the prompt never change once the request exists."""
        params = self.sampling_params
        eos = () if params.ignore_eos else self.eos_token_ids
        limit = self.max_total_tokens - len(self.prompt_token_ids)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        return frozenset((*eos, *params.stop_token_ids)), limit

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing applied before the argmax: no penalty, logit bias, allowed
        tokens, logprobs nor min_tokens (a grammar is the matcher's, checked apart: it comes
        and goes). The runner samples a batch of only such requests without a row each
        (sampler.GreedyRows). Kept: the params never change."""
        p = self.sampling_params
        return (
            p.is_greedy
            and not p.has_penalties
            and not p.logit_bias
            and p.allowed_token_ids is None
            and p.logprobs is None
            and p.min_tokens == 0
        )

    @functools.cached_property
    def host_bound(self) -> bool:
        """Whether a step that samples it needs the host to have read its last token first
        (penalties over the outputs, logprobs, prompt logprobs, a grammar's mask): async
        scheduling runs such steps synchronously (engine/async_step.py). Not min_tokens:
        its mask needs only the count of tokens, the one in flight included
        (SamplingRow.num_pending). Kept: the params never change."""
        p = self.sampling_params
        return (
            p.has_penalties
            or p.logprobs is not None
            or p.prompt_logprobs is not None
            or p.structured_outputs is not None
        )

    def append_output(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.get(token_id, 0.0)

    def resume(self, output_token_ids: Sequence[int]) -> None:
        """Take over the outputs another engine produced (a sequence migrated from a worker
        that died): they are computed again with the prompt, and the next token follows them.
        Their logprobs are placeholders: whoever resumes already has the real ones."""
        self.output_token_ids = list(output_token_ids)
        if self.sampling_params.logprobs is not None:
            self.output_logprobs = [{} for _ in output_token_ids]

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last output token caused, if any (EOS, stop token, length)."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def validate_prompt(
    prompt_token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, kv_capacity: int
) -> list[int]:
    """The prompt as a list of ints, checked against the model and the KV cache.

    Raises:
        ValueError: an empty prompt, a token outside [0, vocab_size), or a prompt that leaves
            no room for a generated token in max_model_len or in the KV cache's `kv_capacity`
            tokens.
    """
    ids = [int(t) for t in prompt_token_ids]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    check_vocab("prompt", ids, vocab_size)
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len}: it must "
            "leave room for at least one generated token; shorten the prompt or raise "
            "max_model_len"
        )
    if len(ids) + 1 > kv_capacity:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the KV cache holds only {kv_capacity}; "
            "raise num_blocks / kv_cache_memory"
        )
    return ids
