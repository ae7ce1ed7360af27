"""OpenAI request bodies (with vLLM's extra fields), validated by pydantic.

No field is silently ignored: a field is implemented by declaring it here, and any other is
refused with a 400 naming it (kvrelay.api.openai_body). An explicit JSON null means the field's
default, as OpenAI and vLLM read it. pydantic only parses JSON types here; the rules live in
kvrelay.router.prompts, shared with the gRPC API.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import PrivateAttr

from kvrelay.api.openai_body import Accepted, RequestBody
from kvrelay.api.openai_structured import StructuredFields
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.tool_requests import ToolPlan, tool_plan

_Body = RequestBody  # every request model's base: undeclared fields are refused


_TOKEN_ID = re.compile(r"-?[0-9]+")
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # gRPC's int32


def token_biases(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as JSON strings, keyed by ints (the
    ranges are checked with the other sampling fields)."""
    if not raw:
        return None
    biases: dict[int, float] = {}
    for key, value in raw.items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (decimal integers), got {key[:40]!r}",
                "logit_bias",
            )
        token = int(key)
        if token in biases:
            raise InvalidRequestError(f"logit_bias names token {token} twice", "logit_bias")
        biases[token] = value
    return biases


def check_prompt_logprobs(body: Any) -> None:
    """As vLLM: prompt_logprobs are not streamed (their range is checked by SamplingParams)."""
    if body.stream and body.prompt_logprobs is not None:
        message = "prompt_logprobs are not available when stream is true"
        raise InvalidRequestError(message, "prompt_logprobs")


class StreamOptions(_Body):
    accepted_values: ClassVar[Accepted] = {"include_obfuscation": (False,)}
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) in every streamed chunk


# Undeclared fields both endpoints accept at the one value that changes nothing here.
_ACCEPTED_VALUES: Accepted = {
    "store": (False,),  # nothing is stored: metadata, which only labels stored ones, is refused
    "service_tier": ("auto", "default"),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "max_repetition_pattern_size": (0,),
    "min_repetition_pattern_size": (0,),
    "repetition_min_count": (0,),
    # vLLM's default; its fast tokenizers' detokenizing (and ours) reads no other value
    "spaces_between_special_tokens": (True,),
}


class _Sampling(StructuredFields):
    """Fields common to both endpoints: OpenAI's, then vLLM's extras (the structured-output
    ones in StructuredFields)."""

    accepted_values: ClassVar[Accepted] = _ACCEPTED_VALUES

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
    user: str | None = None  # an end user's id, for the client's own records (not acted on)
    safety_identifier: str | None = None  # OpenAI's newer name for the same
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
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top k
    priority: int = 0  # vLLM's: lower first among the sender's waiting requests
    return_token_ids: bool = False  # vLLM's: prompt and output token ids beside the text
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as "token_id:N"
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    request_id: str | None = None  # vLLM's: the response's id is cmpl-/chatcmpl- + it

    def check_priority(self) -> None:
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise InvalidRequestError(
                f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {self.priority}",
                "priority",
            )

    def check_supported(self) -> None:
        """Refuse fields we cannot honour (InvalidRequestError naming the field)."""
        self.refuse_unknown()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options needs stream set to true", "stream_options")
        self.check_priority()
        self.check_constraint()

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
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
            "logit_bias": token_biases(self.logit_bias),
            "prompt_logprobs": self.prompt_logprobs,
            "structured_outputs": self.output_constraint,
            "allowed_token_ids": self.allowed_token_ids,
        }

    @property
    def field_names(self) -> dict[str, str]:
        """Wire names of SamplingParams fields spelled differently here."""
        return self.constraint_names

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like (text prompts)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        check_prompt_logprobs(self)
        if self.max_tokens == 0 and not self.echo:  # vLLM's: the prompt's logprobs alone
            raise InvalidRequestError("max_tokens 0 needs echo set to true", "max_tokens")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as sent: one (text or token ids), or a list of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]  # type: ignore[list-item]


class ChatMessage(_Body):
    """Role and content as sent: kvrelay.router.prompts.chat_messages checks them."""

    role: Any = None
    content: Any = None
    tool_calls: Any = None  # an assistant's calls (router.tool_messages checks them)
    tool_call_id: Any = None  # a tool message's: the call it answers
    name: Any = None  # OpenAI's participant name (given to templates that read it)


class ChatCompletionRequest(_Sampling):
    accepted_values: ClassVar[Accepted] = {
        **_ACCEPTED_VALUES,
        "modalities": (["text"],),
        "include_reasoning": (True,),  # this model writes no separate reasoning
        "continue_final_message": (False,),
    }
    messages: list[ChatMessage]
    add_special_tokens: bool = False  # vLLM's: the template writes its own; true adds BOS too
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Any = None  # extra template variables (router.template_kwargs)
    # Tool calling (router.tool_requests checks them; functions / function_call are refused)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)

    def check_supported(self) -> None:
        super().check_supported()
        check_prompt_logprobs(self)
        self.tool_plan()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequestError(
                f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}",
                "max_completion_tokens",
            )

    @property
    def output_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        """Wire names of SamplingParams fields that chat spells differently."""
        names = {**super().field_names, "logprobs": "top_logprobs", "prompt": "messages"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_plan(self) -> ToolPlan:
        """The request's tool fields, checked once (InvalidRequestError naming the field)."""
        if self._tool_plan is None:
            self._tool_plan = tool_plan(
                self.tools,
                self.tool_choice,
                self.parallel_tool_calls,
                self.functions,
                self.function_call,
            )
        return self._tool_plan

    def template_messages(self) -> list[dict[str, Any]]:
        messages = []
        for m in self.messages:
            message = {"role": m.role, "content": m.content}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls is not None:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages
