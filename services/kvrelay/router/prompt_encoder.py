"""Tokenizing and chat templating off the event loop, so that no prompt, however long, stalls
other clients' streams or /health.

A prompt far longer than the context length is refused before it is tokenized at all: a token
covers at most `max_token_chars` characters of text, so a text longer than max_model_len times
that (with a margin for normalisation) cannot fit. Tokenizing 20 MB took 28 s; this check takes
microseconds. What remains runs on one worker thread (a fast tokenizer is not safe to call from
several threads at once).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvrelay.router.prompts import check_text
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.tool_messages import (
    hermes_messages,
    needs_tool_rendering,
    template_takes_tools,
)

T = TypeVar("T")
# Normalisers may merge characters (NFC joins "e" + U+0301): leave room before refusing.
_NORMALISATION_MARGIN = 4


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * _max_token_chars(tokenizer) * _NORMALISATION_MARGIN
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-tokenize")

    async def encode(
        self, text: str, param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """`text`'s token ids, the tokenizer's special tokens (BOS, ...) added unless
        `add_special_tokens` is false (vLLM's default and field)."""
        self._check(text, param)
        if not text:
            raise InvalidRequestError("the prompt is empty", param)
        return await self._run(encode_text, self.tokenizer, text, add_special_tokens)

    async def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """The chat template applied to validated messages (prompts.chat_messages): (text, ids).
        The template writes its own special tokens; `add_special_tokens` adds the tokenizer's
        too (vLLM's field, default false).
        `tools` (OpenAI's shape) go to a template that reads them; for one that does not, the
        tools, calls and results are written into the turns (router.tool_messages).
        `variables`: extra template variables (checked by router.template_kwargs)."""
        for i, message in enumerate(messages):
            self._check(message["content"], f"messages.{i}.content")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model has no chat template: use /v1/completions with plain text", "messages"
            )
        if not template_takes_tools(template) and (tools or needs_tool_rendering(messages)):
            messages, tools = hermes_messages(messages, tools), None
        return await self._run(
            _render,
            self.tokenizer,
            list(messages),
            add_generation_prompt,
            tools,
            variables,
            add_special_tokens,
        )

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer's thread, for other code that reads the tokenizer."""
        return await self._run(fn, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _check(self, text: str, param: str) -> None:
        check_text(text, param)
        if self.tokenizer is None:
            message = "this server takes token ids only (it has no tokenizer)"
            raise InvalidRequestError(message, param)
        if len(text) > self.max_chars:
            raise InvalidRequestError(
                f"{param} has {len(text)} characters, far more than the context length of "
                f"{self.max_model_len} tokens can hold: shorten it",
                param,
            )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    variables: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> tuple[str, list[int]]:
    """The template's text and its ids, in one trip to the tokenizer's thread."""
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(variables or {}),
        )
    except Exception as exc:  # a template's own raise_exception, e.g. roles out of order
        message = f"the chat template rejected the messages: {exc}"
        raise InvalidRequestError(message, "messages") from exc
    return text, encode_text(tokenizer, text, add_special_tokens)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids; the tokenizer's special tokens added when `add_special_tokens`."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _max_token_chars(tokenizer: Any) -> int:
    """The most characters any one token (added tokens included) stands for."""
    if tokenizer is None:
        return 1
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1
