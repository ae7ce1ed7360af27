"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, plus
/health and /metrics. Errors in OpenAI's shape with the status codes of ARCHITECTURE.md s. 3."""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.api.auth import check_api_key
from kvrelay.api.disconnect import ClientGoneError, EventStreamResponse, until_disconnected
from kvrelay.api.openai_format import OpenAIFormatter, error_body, router_error_body
from kvrelay.api.openai_protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from kvrelay.router.errors import OverloadedError, RouterError
from kvrelay.router.prompts import encode_prompt, render_chat, sampling_params
from kvrelay.router.router import Router
from kvrelay.router.types import GenerateChunk, GenerateRequest


def create_http_app(router: Router, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvrelay", summary="OpenAI-compatible API of kvrelay", docs_url="/docs")
    _add_error_handlers(app)
    _add_probe_routes(app, router)
    v1 = [Depends(_authenticator(api_key))]
    _add_model_routes(app, router, v1)
    _add_generation_routes(app, router, v1)
    return app


def _authenticator(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that checks the `Authorization: Bearer KEY` header of /v1 routes."""

    async def authenticate(request: Request) -> None:
        header = request.headers.get("authorization", "")
        check_api_key(header, api_key, "Authorization: Bearer KEY")

    return authenticate


def _add_probe_routes(app: FastAPI, router: Router) -> None:
    """/health (readiness, 503 while draining or without a decode worker) and /metrics."""

    @app.get("/health")
    async def health() -> Response:
        if router.is_ready():
            return JSONResponse({"status": "ok"})
        reason = "draining" if router.draining else "no decode worker"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_model_routes(app: FastAPI, router: Router, v1: list[Any]) -> None:
    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        card = router.model
        return {
            "object": "list",
            "data": [
                {
                    "id": card.id,
                    "object": "model",
                    "created": card.created,
                    "owned_by": "kvrelay",
                    "max_model_len": card.max_model_len,
                }
            ],
        }


def _add_generation_routes(app: FastAPI, router: Router, v1: list[Any]) -> None:
    """/v1/completions and /v1/chat/completions."""
    tokenizer = router.tokenizer

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        router.check_model(body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = encode_prompt(tokenizer, prompt)
        else:
            text, ids = None, list(prompt)
        fields = body.sampling_fields(body.max_tokens, body.logprobs)
        greq = _request(body, ids, text, fields, body.max_tokens)
        fmt = OpenAIFormatter(
            greq.request_id, router.model.id, False, tokenizer, body.logprobs or 0
        )
        return await _respond(router, request, body, greq, fmt, body.logprobs is not None)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        router.check_model(body.model)
        messages = [m.as_template_input() for m in body.messages]
        text, ids = render_chat(tokenizer, messages, body.add_generation_prompt)
        fields = body.sampling_fields(body.output_limit, body.num_logprobs)
        greq = _request(body, ids, text, fields, body.output_limit)
        fmt = OpenAIFormatter(
            greq.request_id, router.model.id, True, tokenizer, body.top_logprobs or 0
        )
        return await _respond(router, request, body, greq, fmt, body.logprobs)


def _request(
    body: _Sampling,
    ids: list[int],
    text: str | None,
    fields: dict[str, Any],
    max_tokens: int | None,
) -> GenerateRequest:
    params = sampling_params(fields)
    if max_tokens is None:  # OpenAI's meaning: up to the context length
        params = dataclasses.replace(params, max_tokens=None)
    return GenerateRequest(
        uuid.uuid4().hex,
        ids,
        params,
        body.model,
        text,
        body.include_stop_str_in_output,
    )


async def _respond(
    router: Router,
    request: Request,
    body: _Sampling,
    greq: GenerateRequest,
    fmt: OpenAIFormatter,
    want_logprobs: bool,
) -> Response:
    # Refuse bad input and overload with a status line, before any stream starts.
    ticket = router.admit(greq)
    chunks: AsyncIterator[GenerateChunk] = router.generate(greq, ticket)
    if body.stream:
        events = fmt.sse(chunks, body.include_usage, want_logprobs)
        return EventStreamResponse(events, on_close=ticket.release)
    try:
        whole = await until_disconnected(request, fmt.whole(chunks, body.n, want_logprobs))
    except ClientGoneError:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    finally:
        ticket.release()
    return JSONResponse(whole)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> Response:
        headers = {}
        if isinstance(exc, OverloadedError):
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return JSONResponse(router_error_body(exc), exc.status.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('ctx', {})}", None
        elif param:
            message = f"{param}: {message}"
        return JSONResponse(error_body(message, "invalid_request_error", 400, param), 400)
