"""A request as the router sees it, and what it streams back (wire-independent)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from kvrelay.common.messages import PromptLogprob
from kvrelay.common.sampling_params import SamplingParams


def new_request_id() -> str:
    """A request id made by the server: the key of a request at the router and its workers.
    A client's own id is only a label (GenerateRequest.label), so no client can reach, abort
    or probe another's request by naming its id."""
    return uuid.uuid4().hex


@dataclass
class GenerateRequest:
    request_id: str  # new_request_id(): never a client's string
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str | None = None  # None: the server's only model
    prompt_text: str | None = None
    include_stop_str_in_output: bool = False
    timeout_s: float | None = None  # the client's deadline, from now
    label: str | None = None  # the client's own request id, echoed back, never a key
    # The wire's name of a SamplingParams field where it differs (chat's "max_completion_tokens",
    # gRPC's "sampling.seed"), so every error names the field the client actually sent.
    field_names: Mapping[str, str] = field(default_factory=dict)
    tenant: str = "default"  # who sent it (router/tenant_limits.py): its fair share and limits
    priority: int = 0  # vLLM's: lower first among the tenant's waiting requests

    def param(self, name: str) -> str:
        return self.field_names.get(name, name)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: an echoed prompt's first token (nothing to score it by)
    top: list[tuple[int, float]]  # the top-k (token id, logprob), best first


@dataclass
class ChoiceDelta:
    """One sample's news: new tokens and text, and its finish once it has one."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    # The prompt's logprobs (params.prompt_logprobs), once, on sample 0's first news.
    prompt_logprobs: list[PromptLogprob] | None = None

    def merge(self, later: ChoiceDelta) -> None:
        """Append a later delta of the same sample (coalescing when the client lags)."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *later.logprobs]
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerateChunk:
    request_id: str
    choices: list[ChoiceDelta]
    usage: Usage | None = None  # on the last chunk only


async def collect_chunks(chunks: AsyncIterator[GenerateChunk], request_id: str) -> GenerateChunk:
    """A whole (non-streamed) response: every sample's deltas merged into one chunk, samples in
    index order, with the usage of the last chunk."""
    merged: dict[int, ChoiceDelta] = {}
    usage = None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for delta in chunk.choices:
            if delta.index in merged:
                merged[delta.index].merge(delta)
            else:
                merged[delta.index] = dataclasses.replace(delta, token_ids=list(delta.token_ids))
    return GenerateChunk(request_id, [merged[i] for i in sorted(merged)], usage)
