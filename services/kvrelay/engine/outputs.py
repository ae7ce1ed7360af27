"""What the engine returns to its callers, in vLLM's shape: RequestOutput with CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.common.messages import KVHandle, PromptLogprob


@dataclass(slots=True)  # one of each per running request per step: slots build faster
class CompletionOutput:
    """One sample (of `n`) of a request, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    # Per output token: {token id: logprob} of the sampled token and the top-n; None if not asked.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)  # one of each per running request per step: slots build faster
class RequestOutput:
    """A request's state after a step: its prompt and its `n` samples so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # "arrival_time" and, once a token exists, "first_token_time" (time.monotonic() seconds,
    # so TTFT = first_token_time - arrival_time); "num_cached_tokens": prompt tokens found in
    # the prefix cache at admission.
    metrics: dict[str, float] = field(default_factory=dict)
    # Prefill role: where the prompt's KV waits for a decode engine (finished is True then,
    # with no finish_reason: the request goes on elsewhere).
    kv_handle: KVHandle | None = None
    # Set when the engine failed this request alone (finished, every sample aborted, its blocks
    # freed): a message for the client. The worker raises it as RequestFailedError.
    error: str | None = None
    # With params.prompt_logprobs, once every prompt token is scored: an entry per prompt
    # token from the second on (vLLM's list without its leading None).
    prompt_logprobs: list[PromptLogprob] | None = None


class StepDelta(NamedTuple):
    """What one step produced, as news only (`Engine.step_delta`; vLLM's
    `RequestOutputKind.DELTA` in spirit): a running request of one plain sample (no text,
    logprobs or prompt logprobs) whose output was handed over before gets its new token as one
    entry of two parallel lists, not a cumulative RequestOutput rebuilt every step; every other
    request touched (its first output, any finish, an error, a hand-off, text, logprobs, n > 1)
    gets its cumulative `RequestOutput` in `outputs`, as `Engine.step` gives it. A request is
    in the rows or in `outputs`, never both, and once finished never again."""

    request_ids: list[str]  # the rows: each one's request id (sample 0 of it)
    token_ids: list[int]  # each row's new token, appended to its sample 0
    outputs: list[RequestOutput]
