"""kvrelay.v1 protobuf messages <-> the router's types."""

from __future__ import annotations

from typing import Any

from kvrelay.common.structured_outputs import StructuredOutputs
from kvrelay.router.prompts import (
    chat_messages,
    client_label,
    output_constraint,
    prompt_token_ids,
    sampling_params,
)
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.router import Router
from kvrelay.router.tenant_limits import DEFAULT_TENANT
from kvrelay.router.types import ChoiceDelta, GenerateChunk, GenerateRequest, Usage, new_request_id
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


# Sampling fields live in the `sampling` message: errors name them so.
_FIELD_NAMES = {
    name: f"sampling.{name}"
    for name in (
        *_OPTIONAL_FIELDS,
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "logit_bias",
        "allowed_token_ids",
    )
}


async def to_request(
    message: Any, router: Router, timeout_s: float | None, tenant: str = DEFAULT_TENANT
) -> GenerateRequest:
    """A GenerateRequest message as the router's request (of `tenant`): tokenized off the
    event loop and checked by the same validator as the HTTP API (kvrelay.router.prompts)."""
    names = dict(_FIELD_NAMES)
    text, ids = await _prompt(message, router, names)
    options = message.sampling
    fields: dict[str, Any] = {
        name: getattr(options, name) for name in _OPTIONAL_FIELDS if options.HasField(name)
    }
    fields["stop"] = list(options.stop)
    fields["stop_token_ids"] = list(options.stop_token_ids)
    fields["ignore_eos"] = options.ignore_eos
    fields["logit_bias"] = dict(options.logit_bias)
    fields["allowed_token_ids"] = list(options.allowed_token_ids) or None  # empty: any token
    fields["structured_outputs"], param = _constraint(options)
    if param is not None:
        names["structured_outputs"] = param
    if not options.HasField("max_tokens"):
        fields["max_tokens"] = 16  # the proto's documented default
    priority = message.priority  # int32 on the wire: every value is in range
    label = client_label(message.request_id)
    return GenerateRequest(
        new_request_id(),
        ids,
        sampling_params(fields, names),
        message.model or None,
        text,
        options.include_stop_str_in_output,
        timeout_s,
        label=label,
        field_names=names,
        tenant=tenant,
        priority=priority,
    )


def _constraint(options: Any) -> tuple[StructuredOutputs | None, str | None]:
    """The `structured_outputs` message through the validator HTTP uses (its oneof's field
    names are StructuredKind's values)."""
    if not options.HasField("structured_outputs"):
        return None, None
    message = options.structured_outputs
    which = message.WhichOneof("constraint")
    if which is None:
        return None, None
    value = list(message.choice.values) if which == "choice" else getattr(message, which)
    param = f"sampling.structured_outputs.{which}"
    return output_constraint([(param, which, value)], message.any_whitespace)


async def _prompt(
    message: Any, router: Router, names: dict[str, str]
) -> tuple[str | None, list[int]]:
    """(text, token ids) of whichever input the message set; `names["prompt"]` set to it."""
    which = message.WhichOneof("input")
    names["prompt"] = which or "prompt"
    if which == "prompt":
        return message.prompt, await router.encoder.encode(message.prompt)
    if which == "prompt_token_ids":
        return None, prompt_token_ids(list(message.prompt_token_ids.ids), which)
    if which == "messages":
        chat = chat_messages(
            [{"role": m.role, "content": m.content} for m in message.messages.messages]
        )
        return await router.encoder.render_chat(chat)
    raise InvalidRequestError("set one of prompt, prompt_token_ids or messages", "input")


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


def response_message(
    chunk: GenerateChunk, tokenizer: Any, top_k: int = 0, label: str | None = None
) -> Any:
    """The response message; its request_id is the client's own label when it sent one."""
    choices = [choice_message(c, tokenizer, top_k) for c in chunk.choices]
    response = pb.GenerateResponse(request_id=label or chunk.request_id, choices=choices)
    if chunk.usage is not None:
        response.usage.CopyFrom(usage_message(chunk.usage))
    return response
