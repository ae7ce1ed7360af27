"""Router chunks -> OpenAI response objects, whole and streamed (SSE), for both endpoints."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.api.tool_calls import ToolCallParser
from kvrelay.router.request_errors import RouterError
from kvrelay.router.types import ChoiceDelta, GenerateChunk, TokenLogprob, Usage, collect_chunks

logger = logging.getLogger(__name__)


def error_body(
    message: str, error_type: str, status: int, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def router_error_body(exc: RouterError) -> dict[str, Any]:
    status = exc.status
    return error_body(exc.message, status.error_type, status.http_status, exc.param)


def usage_body(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


@dataclass(frozen=True)
class PromptIds:
    """vLLM's `return_token_ids`: each prompt's token ids (choice i belongs to prompt i // n).
    A completion choice carries its prompt's ids, a chat response carries them once; every
    choice (and streamed chunk) carries the token ids it generated."""

    prompts: list[list[int]]
    n: int

    def of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]


class OpenAIFormatter:
    """Formats one request's chunks for `/v1/completions` (chat=False) or
    `/v1/chat/completions` (chat=True)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        tokenizer: Any,
        top_logprobs: int = 0,
        tool_parsers: Callable[[], ToolCallParser] | None = None,
        token_ids: PromptIds | None = None,
        ids_as_tokens: bool = False,
    ) -> None:
        self.top_logprobs = top_logprobs  # how many alternatives to show per token
        self.token_ids = token_ids  # None unless the request set return_token_ids
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", which stay
        # apart where two ids decode to the same text (or to no valid UTF-8 alone).
        self.ids_as_tokens = ids_as_tokens
        # Chat with tools: a tool-call parser per choice (kvrelay.api.tool_call_parsers).
        self._tool_parsers = tool_parsers
        self._parsers: dict[int, ToolCallParser] = {}
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._object = "chat.completion" if chat else "text_completion"

    # -- whole responses --

    async def whole(
        self, chunks: AsyncIterator[GenerateChunk], n: int, want_logprobs: bool
    ) -> dict[str, Any]:
        whole = await collect_chunks(chunks, self.id)
        by_index = {choice.index: choice for choice in whole.choices}
        choices = [by_index.get(index, ChoiceDelta(index)) for index in range(n)]
        body: dict[str, Any] = {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": [self._whole_choice(c, want_logprobs) for c in choices],
        }
        if whole.usage is not None:
            body["usage"] = usage_body(whole.usage)
        if self.chat and self.token_ids is not None:
            body["prompt_token_ids"] = self.token_ids.of(0)
        return body

    def _whole_choice(self, choice: ChoiceDelta, want_logprobs: bool) -> dict[str, Any]:
        logprobs = self._logprobs(choice.logprobs or [], 0) if want_logprobs else None
        out: dict[str, Any] = {"index": choice.index}
        finish_reason = choice.finish_reason
        if self.chat:
            out["message"] = {"role": "assistant", "content": choice.text}
            if self._tool_parsers is not None:
                content, calls = self._tool_parsers().whole(choice.text)
                out["message"]["content"] = content
                if calls:
                    out["message"]["tool_calls"] = calls
                    finish_reason = _tool_finish(finish_reason)
        else:
            out["text"] = choice.text
        out.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=choice.stop_reason)
        self._add_token_ids(out, choice, first=True)
        return out

    def _add_token_ids(self, out: dict[str, Any], choice: ChoiceDelta, first: bool) -> None:
        """With return_token_ids: the choice's generated ids, and on a completion choice's
        first appearance its prompt's ids (chat sends those once, beside the choices)."""
        if self.token_ids is None:
            return
        out["token_ids"] = list(choice.token_ids)
        if first and not self.chat:
            out["prompt_token_ids"] = self.token_ids.of(choice.index)

    # -- streamed responses --

    async def sse(
        self,
        chunks: AsyncIterator[GenerateChunk],
        include_usage: bool,
        want_logprobs: bool,
        running_usage: int | None = None,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events, ending with `data: [DONE]`; a failure mid-stream becomes an
        error event (the status line has gone out already). With `running_usage` (the prompt's
        token count: vLLM's continuous_usage_stats) every chunk carries the usage so far."""
        started: set[int] = set()
        offsets: dict[int, int] = {}
        generated = 0
        prompt_ids_sent = False  # chat's prompt_token_ids go out in the first chunk
        try:
            async for chunk in chunks:
                choices = [
                    self._stream_choice(d, started, offsets, want_logprobs) for d in chunk.choices
                ]
                generated += sum(len(d.token_ids) for d in chunk.choices)
                so_far: Usage | bool | None = None if not include_usage else False
                if running_usage is not None:
                    so_far = Usage(running_usage, generated)
                if choices:
                    yield self._event(choices, so_far, prompt_ids_sent)
                    prompt_ids_sent = True
                if chunk.usage is not None and include_usage:
                    yield self._event([], chunk.usage)
        except RouterError as exc:
            yield f"data: {json.dumps(router_error_body(exc))}\n\n"
        except Exception:  # never a cut stream: the client gets an error event and [DONE]
            logger.exception("stream %s failed", self.id)
            message = "the server failed this request; it has been logged"
            yield f"data: {json.dumps(error_body(message, 'internal_error', 500))}\n\n"
        yield "data: [DONE]\n\n"

    def _event(
        self,
        choices: list[dict[str, Any]],
        usage: Usage | bool | None,
        prompt_ids_sent: bool = True,
    ) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": f"{self._object}.chunk" if self.chat else self._object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.chat and self.token_ids is not None and not prompt_ids_sent:
            body["prompt_token_ids"] = self.token_ids.of(0)
        if usage is not None:  # False: usage asked for, comes later (OpenAI sends null)
            body["usage"] = usage_body(usage) if isinstance(usage, Usage) else None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _stream_choice(
        self,
        delta: ChoiceDelta,
        started: set[int],
        offsets: dict[int, int],
        want_logprobs: bool,
    ) -> dict[str, Any]:
        first = delta.index not in offsets
        offset = offsets.get(delta.index, 0)
        offsets[delta.index] = offset + len(delta.text)
        logprobs = self._logprobs(delta.logprobs or [], offset) if want_logprobs else None
        out: dict[str, Any] = {"index": delta.index}
        finish_reason = delta.finish_reason
        if self.chat:
            message: dict[str, Any] = {"content": delta.text}
            if self._tool_parsers is not None:
                message, finish_reason = self._tool_delta(delta)
            if delta.index not in started:
                message = {"role": "assistant", **message}
                started.add(delta.index)
            out["delta"] = message
        else:
            out["text"] = delta.text
        out.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=delta.stop_reason)
        self._add_token_ids(out, delta, first)
        return out

    def _tool_delta(self, delta: ChoiceDelta) -> tuple[dict[str, Any], str | None]:
        """A chat delta read for tool calls: (its content and tool_calls, finish_reason)."""
        assert self._tool_parsers is not None
        parser = self._parsers.get(delta.index)
        if parser is None:
            parser = self._parsers[delta.index] = self._tool_parsers()
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.extend(parser.finish())
        message: dict[str, Any] = {}
        if parsed.content or not parsed.calls:
            message["content"] = parsed.content
        if parsed.calls:
            message["tool_calls"] = parsed.openai_calls()
        finish = delta.finish_reason
        return message, _tool_finish(finish) if parser.called else finish

    # -- logprobs --

    def _token(self, token_id: int) -> str:
        if self.ids_as_tokens:
            return f"token_id:{token_id}"
        return str(self._tokenizer.decode([token_id]))

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens, token_logprobs, offsets = [], [], []
        tops: list[dict[str, float] | None] = []
        for entry in entries:
            token = self._token(entry.token_id)
            tokens.append(token)
            token_logprobs.append(entry.logprob)
            top = {self._token(t): lp for t, lp in entry.top[: self.top_logprobs]}
            tops.append(None if entry.logprob is None else top)  # an echoed first token: None
            offsets.append(text_offset)
            text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_logprob(self, entry: TokenLogprob) -> dict[str, Any]:
        def item(token_id: int, logprob: float | None) -> dict[str, Any]:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        out = item(entry.token_id, entry.logprob)
        # The engine's entry holds the sampled token as well as the top k: keep the top k.
        out["top_logprobs"] = [item(t, lp) for t, lp in entry.top[: self.top_logprobs]]
        return out


def _tool_finish(finish_reason: str | None) -> str | None:
    """OpenAI's finish_reason of a reply that called tools: "tool_calls" if it ended itself."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
