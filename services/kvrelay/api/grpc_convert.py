"""kvrelay.v1 protobuf messages <-> the router's types."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kvrelay.router.errors import InvalidRequestError
from kvrelay.router.prompts import encode_prompt, render_chat, sampling_params
from kvrelay.router.types import ChoiceDelta, GenerateChunk, GenerateRequest, Usage
from kvrelay.v1 import generation_pb2 as pb

_OPTIONAL_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
)
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def to_request(message: Any, tokenizer: Any, timeout_s: float | None) -> GenerateRequest:
    """A GenerateRequest message as the router's request (tokenized, params validated)."""
    which = message.WhichOneof("input")
    text: str | None = None
    if which == "prompt":
        text = message.prompt
        ids = encode_prompt(tokenizer, text)
    elif which == "prompt_token_ids":
        ids = list(message.prompt_token_ids.ids)
    elif which == "messages":
        chat = [{"role": m.role, "content": m.content} for m in message.messages.messages]
        text, ids = render_chat(tokenizer, chat)
    else:
        raise InvalidRequestError("set one of prompt, prompt_token_ids or messages", "input")
    options = message.sampling
    fields: dict[str, Any] = {
        name: getattr(options, name) for name in _OPTIONAL_FIELDS if options.HasField(name)
    }
    fields["stop"] = list(options.stop)
    fields["stop_token_ids"] = list(options.stop_token_ids)
    fields["ignore_eos"] = options.ignore_eos
    params = sampling_params(fields)
    if not options.HasField("max_tokens"):
        params = dataclasses.replace(params, max_tokens=16)
    return GenerateRequest(
        message.request_id or uuid.uuid4().hex,
        ids,
        params,
        message.model or None,
        text,
        options.include_stop_str_in_output,
        timeout_s,
    )


def choice_message(delta: ChoiceDelta, tokenizer: Any, top_k: int) -> Any:
    choice = pb.Choice(
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=_FINISH[delta.finish_reason],
        stop_reason="" if delta.stop_reason is None else str(delta.stop_reason),
    )
    for entry in delta.logprobs or []:
        choice.logprobs.append(
            pb.TokenLogprob(
                token_id=entry.token_id,
                logprob=entry.logprob,
                token=tokenizer.decode([entry.token_id]),
                top_logprobs=[
                    pb.TopLogprob(token_id=t, logprob=lp, token=tokenizer.decode([t]))
                    for t, lp in entry.top[:top_k]  # the sampled token may trail the top k
                ],
            )
        )
    return choice


def usage_message(usage: Usage) -> Any:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.cached_tokens,
    )


def response_message(chunk: GenerateChunk, tokenizer: Any, top_k: int = 0) -> Any:
    choices = [choice_message(c, tokenizer, top_k) for c in chunk.choices]
    response = pb.GenerateResponse(request_id=chunk.request_id, choices=choices)
    if chunk.usage is not None:
        response.usage.CopyFrom(usage_message(chunk.usage))
    return response
