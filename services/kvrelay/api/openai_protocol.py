"""OpenAI request bodies (with vLLM's extra sampling fields), validated by pydantic.

Unknown fields are accepted and ignored, as vLLM does, so newer clients keep working; fields
we cannot honour (tools, echo, logit_bias, suffix, best_of > n) are refused with a 400 rather
than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvrelay.router.errors import InvalidRequestError


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields common to both endpoints: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", "logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "stop": stop,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("send one prompt per request", "prompt")
            first = prompt[0]
            assert isinstance(first, (str, list))
            return first
        return prompt  # type: ignore[return-value]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
