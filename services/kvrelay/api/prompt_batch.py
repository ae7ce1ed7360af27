"""The prompts of one API request run as one: a list of prompts in /v1/completions (each its
own router request), or the one prompt of any other request.

Admitted together or refused together; their chunks merged with OpenAI's choice indices
(prompt i, sample j -> i * n + j) and their usage summed. On the way, `echo` prepends the
prompt (its text, and with logprobs its tokens' logprobs) to each choice, and the prompt's
logprobs (vLLM's prompt_logprobs) are kept for the whole response.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.api.openai_format import PromptIds
from kvrelay.api.openai_protocol import CompletionRequest
from kvrelay.common.messages import PromptLogprob
from kvrelay.common.sampling_params import check_vocab
from kvrelay.router.prompts import prompt_token_ids, truncated_prompt
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.router import Router
from kvrelay.router.types import ChoiceDelta, GenerateChunk, GenerateRequest, TokenLogprob, Usage

# Builds one prompt's request from its ids, text, sampling fields and wire names.
RequestMaker = Callable[[list[int], str | None, dict[str, Any], dict[str, str]], GenerateRequest]


@dataclass(frozen=True)
class Echo:
    """What `echo` prepends: each prompt's text, and its tokens' logprobs when asked."""

    texts: list[str]
    logprobs: bool


class PromptBatch:
    def __init__(
        self,
        router: Router,
        requests: list[GenerateRequest],
        echo: Echo | None = None,
        prompt_only: bool = False,
        show_prompt_logprobs: bool | None = None,
    ) -> None:
        """`prompt_only`: echo with max_tokens 0: the one token generated is dropped.
        `show_prompt_logprobs` (default: whether the params ask for them): False when only
        echo asked for them."""
        self.router = router
        self.requests = requests
        self.n = requests[0].params.n
        self.echo = echo
        self.prompt_only = prompt_only
        if show_prompt_logprobs is None:
            show_prompt_logprobs = requests[0].params.prompt_logprobs is not None
        self.show_prompt_logprobs = show_prompt_logprobs
        self.prompt_logprobs: dict[int, list[PromptLogprob]] = {}  # by prompt
        self._tickets: list[Any] = []
        self._echoed: set[int] = set()  # choices whose prompt went out
        self._held: dict[int, list[ChoiceDelta]] = {}  # choices waiting for their prompt's logprobs

    @property
    def request_id(self) -> str:
        return self.requests[0].request_id

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n

    @property
    def prompt_ids(self) -> PromptIds:
        """Each prompt's token ids, for return_token_ids."""
        return PromptIds([list(r.prompt_token_ids) for r in self.requests], self.n)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    async def admit(self) -> None:
        """Every prompt admitted, or none (a refusal of one withdraws the others)."""
        tickets = []
        try:
            for request in self.requests:
                await self.router.check_output_constraint(request)
                tickets.append(self.router.admit(request))
        except BaseException:
            for ticket in tickets:  # never reached `generate`: undo what `admit` counted
                ticket.release()
                self.router.metrics.queued.dec()
            raise
        self._tickets = tickets

    def release(self) -> None:
        for ticket in self._tickets:
            ticket.release()

    def chunks(self) -> AsyncIterator[GenerateChunk]:
        streams = [
            self.router.generate(request, ticket)
            for request, ticket in zip(self.requests, self._tickets, strict=True)
        ]
        wants_prompt = self.requests[0].params.prompt_logprobs is not None
        if len(streams) == 1 and self.echo is None and not wants_prompt:
            return streams[0]  # the common case: nothing to merge or add
        return self._merged(streams)

    async def _merged(
        self, streams: list[AsyncIterator[GenerateChunk]]
    ) -> AsyncGenerator[GenerateChunk, None]:
        queue: asyncio.Queue[tuple[int, GenerateChunk | BaseException | None]] = asyncio.Queue()

        async def pump(prompt: int, stream: AsyncIterator[GenerateChunk]) -> None:
            try:
                async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
                    async for chunk in chunks:
                        queue.put_nowait((prompt, chunk))
            except Exception as exc:
                queue.put_nowait((prompt, exc))
            finally:
                queue.put_nowait((prompt, None))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
        usages: list[Usage] = []
        try:
            remaining = len(tasks)
            while remaining:
                prompt, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    usages.extend([item.usage] if item.usage is not None else [])
                    choices = self._choices(prompt, item.choices)
                    if choices:
                        yield GenerateChunk(self.request_id, choices)
            left = [d for held in self._held.values() for d in held]  # no logprobs came
            if left:
                yield GenerateChunk(self.request_id, [self._echoed_delta(d, []) for d in left])
            yield GenerateChunk(self.request_id, [], self._usage(usages))
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _choices(self, prompt: int, deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
        """One prompt's news with the batch's indices, echo and prompt_only applied."""
        out: list[ChoiceDelta] = []
        for delta in deltas:
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs.setdefault(prompt, delta.prompt_logprobs)
            delta = dataclasses.replace(
                delta, index=prompt * self.n + delta.index, prompt_logprobs=None
            )
            if self.prompt_only:
                finished = delta.finish_reason is not None
                delta = ChoiceDelta(
                    delta.index, logprobs=[] if delta.logprobs is not None else None
                )
                if finished:
                    delta.finish_reason = "length"
            out.extend(self._echo(prompt, delta))
        released = self._release_held(prompt)
        return sorted([*out, *released], key=lambda d: d.index)

    def _echo(self, prompt: int, delta: ChoiceDelta) -> list[ChoiceDelta]:
        echo = self.echo
        if echo is None or delta.index in self._echoed:
            return [delta]
        if echo.logprobs and prompt not in self.prompt_logprobs:
            self._held.setdefault(delta.index, []).append(delta)  # sample 0 brings them
            return []
        self._echoed.add(delta.index)
        return [self._echoed_delta(delta, self._prompt_entries(prompt))]

    def _release_held(self, prompt: int) -> list[ChoiceDelta]:
        if prompt not in self.prompt_logprobs:
            return []
        first, out = prompt * self.n, []
        for index in range(first, first + self.n):
            held = self._held.pop(index, [])
            if held:
                self._echoed.add(index)
                merged = self._echoed_delta(held[0], self._prompt_entries(prompt))
                for later in held[1:]:
                    merged.merge(later)
                out.append(merged)
        return out

    def _echoed_delta(self, delta: ChoiceDelta, entries: list[TokenLogprob]) -> ChoiceDelta:
        assert self.echo is not None
        prompt = delta.index // self.n
        logprobs = None
        if delta.logprobs is not None:
            logprobs = [*entries, *delta.logprobs]
        text = self.echo.texts[prompt] + delta.text
        return dataclasses.replace(delta, text=text, logprobs=logprobs)

    def _prompt_entries(self, prompt: int) -> list[TokenLogprob]:
        """The prompt's tokens as logprob entries: the first has none (nothing before it)."""
        ids = self.requests[prompt].prompt_token_ids
        scored = self.prompt_logprobs.get(prompt, [])
        return [
            TokenLogprob(ids[0], None, []),
            *(TokenLogprob(e.token_id, e.logprob, e.top) for e in scored),
        ]

    def _usage(self, usages: list[Usage]) -> Usage:
        completion = 0 if self.prompt_only else sum(u.completion_tokens for u in usages)
        return Usage(
            sum(u.prompt_tokens for u in usages),
            completion,
            sum(u.cached_tokens for u in usages),
        )

    def finish(self, whole: dict[str, Any], chat: bool) -> dict[str, Any]:
        """A whole response with vLLM's prompt_logprobs, when the request asked for them:
        per choice (completions) or once (chat)."""
        if not self.show_prompt_logprobs:
            return whole
        tokenizer = self.router.tokenizer
        lists = [
            prompt_logprobs_body(r.prompt_token_ids, self.prompt_logprobs.get(i), tokenizer)
            for i, r in enumerate(self.requests)
        ]
        if chat:
            whole["prompt_logprobs"] = lists[0]
        else:
            for choice in whole["choices"]:
                choice["prompt_logprobs"] = lists[choice["index"] // self.n]
        return whole


def prompt_logprobs_body(
    prompt: list[int], entries: list[PromptLogprob] | None, tokenizer: Any
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob,
    rank, decoded_token}} for the prompt's token and the top k."""
    if entries is None:
        return None

    def item(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        decoded = tokenizer.decode([token_id]) if tokenizer is not None else None
        return {"logprob": logprob, "rank": rank, "decoded_token": decoded}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        position = {str(entry.token_id): item(entry.logprob, entry.rank, entry.token_id)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            position.setdefault(str(token_id), item(logprob, rank, token_id))
        out.append(position)
    assert len(out) == len(prompt)
    return out


async def completion_batch(
    router: Router, body: CompletionRequest, make: RequestMaker
) -> PromptBatch:
    """The batch of a /v1/completions body: each prompt encoded and made a request."""
    prompts = body.prompts()
    listed = len(prompts) != 1 or prompts[0] is not body.prompt
    limit = router.admission.max_in_flight  # sequences: every prompt's n of them count
    if len(prompts) * body.n > limit:
        message = (
            f"{len(prompts)} prompts of n={body.n} is {len(prompts) * body.n} sequences, more "
            f"than this server runs at once ({limit}, --max-in-flight): send fewer prompts "
            "per request or lower n"
        )
        raise InvalidRequestError(message, "n" if body.n > 1 else "prompt")
    fields = body.sampling_fields(body.max_tokens, body.logprobs)
    echo_logprobs = body.echo and body.logprobs is not None
    prompt_only = body.echo and body.max_tokens == 0
    if prompt_only:
        fields["max_tokens"] = 1  # generated, then dropped: vLLM's prompt-only request
    if echo_logprobs:  # the prompt's tokens need their logprobs too
        fields["prompt_logprobs"] = max(body.prompt_logprobs or 0, body.logprobs or 0)
    requests, texts = [], []
    for index, prompt in enumerate(prompts):
        param = f"prompt.{index}" if listed else "prompt"
        text, ids = await _encode(router, prompt, param, body.add_special_tokens)
        kept = truncated_prompt(ids, body.truncate_prompt_tokens, router.model.max_model_len)
        if len(kept) < len(ids):  # echo shows the prompt that ran
            text, ids = None, kept
        if body.echo:
            texts.append(text if text is not None else _decode(router, ids, param))
        names = {**body.field_names, "prompt": param}
        requests.append(make(ids, text, fields, names))
    echo = Echo(texts, echo_logprobs) if body.echo else None
    return PromptBatch(router, requests, echo, prompt_only, body.prompt_logprobs is not None)


async def _encode(
    router: Router, prompt: str | list[int], param: str, add_special_tokens: bool
) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        return prompt, await router.encoder.encode(prompt, param, add_special_tokens)
    return None, prompt_token_ids(prompt, param)


def _decode(router: Router, ids: list[int], param: str) -> str:
    """A token-id prompt's text, for echo."""
    tokenizer = router.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("echo needs the model's tokenizer (this server has none)", "echo")
    try:
        check_vocab(param, ids, len(tokenizer))
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param) from None
    return str(tokenizer.decode(ids))
