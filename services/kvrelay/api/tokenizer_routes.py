"""vLLM's /tokenize and /detokenize, and /version, behind the API key of the /v1 routes.

/tokenize takes a prompt (TokenizeCompletionRequest) or chat messages (TokenizeChatRequest),
told apart by `messages`; chat is rendered by the router's prompt encoder, exactly as
/v1/chat/completions renders it. Both answer {count, max_model_len, tokens} (and token_strs
with return_token_strs). /detokenize turns token ids back into {prompt}.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvrelay import __version__
from kvrelay.api.openai_body import RequestBody
from kvrelay.api.openai_protocol import ChatMessage
from kvrelay.common.sampling_params import check_vocab
from kvrelay.router.prompt_encoder import encode_text
from kvrelay.router.prompts import chat_messages, check_text
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.router import Router
from kvrelay.router.template_kwargs import template_kwargs

_T = TypeVar("_T", bound=RequestBody)


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    chat_template_kwargs: Any = None  # extra template variables (router.template_kwargs)
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes its own
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, router: Router, auth: list[Any]) -> None:
    """/tokenize, /detokenize and /version (`auth`: the /v1 routes' dependencies)."""

    @app.get("/version", dependencies=auth)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        request: TokenizeCompletionRequest | TokenizeChatRequest
        if "messages" in body:
            request = _parse(TokenizeChatRequest, body)
            text = await _render(router, request)
        else:
            request = _parse(TokenizeCompletionRequest, body)
            text = _checked(router, request.prompt, "prompt")
        router.check_model(request.model)
        tokenizer, special = router.tokenizer, request.add_special_tokens
        ids = await router.encoder.call(encode_text, tokenizer, text, special)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": router.model.max_model_len,
            "tokens": ids,
        }
        if request.return_token_strs:
            out["token_strs"] = router.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: dict[str, Any] = Body(...)) -> dict[str, str]:  # noqa: B008
        request = _parse(DetokenizeRequest, body)
        router.check_model(request.model)
        tokenizer = _tokenizer(router, "tokens")
        try:
            check_vocab("tokens", request.tokens, len(tokenizer))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "tokens") from None
        text = await router.encoder.call(tokenizer.decode, request.tokens)
        return {"prompt": str(text)}


def _parse(model: type[_T], body: dict[str, Any]) -> _T:
    """`body` as `model`, or the 400 of any other request body (the field named)."""
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    request.refuse_unknown()
    return request


def _tokenizer(router: Router, param: str) -> Any:
    if router.tokenizer is None:
        message = "this server takes token ids only (it has no tokenizer)"
        raise InvalidRequestError(message, param)
    return router.tokenizer


def _checked(router: Router, text: str, param: str) -> str:
    """`text` if the tokenizer can take it: valid Unicode, within what the context could
    hold (the prompt encoder's bound: tokenizing megabytes would hold its thread for seconds)."""
    _tokenizer(router, param)
    check_text(text, param)
    if len(text) > router.encoder.max_chars:
        raise InvalidRequestError(
            f"{param} has {len(text)} characters, far more than the context length of "
            f"{router.model.max_model_len} tokens can hold: shorten it",
            param,
        )
    return text


async def _render(router: Router, request: TokenizeChatRequest) -> str:
    """The chat's text as /v1/chat/completions renders it (the same prompt encoder)."""
    if request.continue_final_message and request.add_generation_prompt:
        message = "continue_final_message and add_generation_prompt cannot both be true"
        raise InvalidRequestError(message, "continue_final_message")
    _tokenizer(router, "messages")
    raw = [m.model_dump(exclude_none=True) for m in request.messages]
    messages = chat_messages(raw, tools=True)
    variables = template_kwargs(request.chat_template_kwargs)
    text, _ = await router.encoder.render_chat(
        messages, request.add_generation_prompt, variables=variables
    )
    if request.continue_final_message:
        text = _continued(text, messages[-1]["content"])
    return text


def _continued(text: str, final: str) -> str:
    """The rendered chat cut after the final message's content (transformers' rule for
    continue_final_message): the model goes on writing that message."""
    final = final.strip()
    end = text.rfind(final)
    if not final or end < 0:
        raise InvalidRequestError(
            "continue_final_message needs a final message whose content the template keeps",
            "messages",
        )
    return text[: end + len(final)]
