"""Typed results of the kvrelay client SDK: plain frozen dataclasses, no protobuf in sight.

Built from responses by `kvrelay.client.convert`; nothing here talks to the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ChatMessage",
    "Choice",
    "ChoiceDelta",
    "FinishReason",
    "GenerateChunk",
    "GenerateResult",
    "Model",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]

# vLLM's / OpenAI's spelling; None while a sample is still generating.
FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and, when asked, the top k alternatives (best first)."""

    token_id: int
    logprob: float
    token: str
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class ChoiceDelta:
    """One sample's new output since the previous chunk."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None  # the stop string or token id that matched, if any


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed response: the samples with news in it; `usage` is set on the last one."""

    request_id: str
    choices: tuple[ChoiceDelta, ...]
    usage: Usage | None = None


@dataclass(frozen=True)
class Choice:
    """One sample's whole output."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    """A whole (non-streamed) generation: every sample, ordered by index, and the usage."""

    request_id: str
    choices: tuple[Choice, ...]
    usage: Usage | None = None

    @property
    def text(self) -> str:
        """The first sample's text (the only one unless n > 1)."""
        return self.choices[0].text if self.choices else ""


@dataclass(frozen=True)
class Model:
    id: str
    max_model_len: int
    created: int  # unix seconds
    owned_by: str = field(default="")
