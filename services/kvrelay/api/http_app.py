"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, plus
/health and /metrics. Errors in OpenAI's shape with the status codes of docs/architecture.md
section 3."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.api.admin import add_admin_routes
from kvrelay.api.auth import AuthenticationError, check_api_key, request_tenant
from kvrelay.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from kvrelay.api.disconnect import ClientGoneError, EventStreamResponse, until_disconnected
from kvrelay.api.http_errors import add_error_handlers
from kvrelay.api.openai_format import OpenAIFormatter
from kvrelay.api.openai_protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from kvrelay.api.prompt_batch import PromptBatch, completion_batch
from kvrelay.api.tokenizer_routes import add_tokenizer_routes
from kvrelay.api.tool_call_parsers import tool_call_parsers
from kvrelay.router.prompts import (
    chat_messages,
    client_label,
    sampling_params,
    truncated_prompt,
)
from kvrelay.router.router import Router
from kvrelay.router.template_kwargs import template_kwargs
from kvrelay.router.types import GenerateChunk, GenerateRequest, new_request_id


def create_http_app(
    router: Router,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    enable_docs: bool = False,
) -> FastAPI:
    """The app; /docs, /redoc and /openapi.json only with `enable_docs` (they map the whole
    API to anyone who can connect, key or not)."""
    app = FastAPI(
        title="kvrelay",
        summary="OpenAI-compatible API of kvrelay",
        docs_url="/docs" if enable_docs else None,
        redoc_url="/redoc" if enable_docs else None,
        openapi_url="/openapi.json" if enable_docs else None,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    add_error_handlers(app)
    _add_probe_routes(app, router)
    v1 = [Depends(_authenticator(api_key, router))]
    _add_model_routes(app, router, v1)
    _add_generation_routes(app, router, v1)
    # The operator's drain API: --api-key only, never a tenant's key.
    add_admin_routes(app, router.registry, [Depends(_operator(api_key, router))])
    add_tokenizer_routes(app, router, v1)  # /tokenize, /detokenize, /version, same key
    return app


def _authenticator(api_key: str | None, router: Router) -> Callable[[Request], Awaitable[None]]:
    """The dependency that checks the `Authorization: Bearer KEY` header of /v1 routes and
    names the request's tenant (request.state.tenant)."""

    async def authenticate(request: Request) -> None:
        book = router.tenants
        header = request.headers.get(book.tenant_header) if book.tenant_header else None
        authorization = request.headers.get("authorization", "")
        how = "Authorization: Bearer KEY"
        request.state.tenant = request_tenant(book, api_key, authorization, header, how)

    return authenticate


def _operator(api_key: str | None, router: Router) -> Callable[[Request], Awaitable[None]]:
    """The admin routes' check: the operator's --api-key (a tenant's key is refused)."""

    async def authenticate(request: Request) -> None:
        if api_key is None and router.tenants.keys:
            raise AuthenticationError(
                "the admin API needs the operator's key: start the server with --api-key "
                "(keys listed in --tenant-limits are tenants' keys)"
            )
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
        body.check_supported()
        router.check_model(body.model)

        def make(
            ids: list[int], text: str | None, fields: dict[str, Any], names: dict[str, str]
        ) -> GenerateRequest:
            return _request(body, ids, text, fields, body.max_tokens, names, request)

        label = response_label(request, body)
        batch = await completion_batch(router, body, make)  # one request per prompt
        fmt = OpenAIFormatter(
            label or batch.request_id,
            router.model.id,
            False,
            tokenizer,
            body.logprobs or 0,
            token_ids=batch.prompt_ids if body.return_token_ids else None,
            ids_as_tokens=body.return_tokens_as_token_ids,
        )
        return await _respond(request, body, batch, fmt, body.logprobs is not None)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check_supported()
        router.check_model(body.model)
        label = response_label(request, body)
        tools = body.tool_plan()
        messages = chat_messages(body.template_messages(), tools=True)
        rendered, ids = await router.encoder.render_chat(
            messages,
            body.add_generation_prompt,
            tools.template_tools(),
            template_kwargs(body.chat_template_kwargs),
            body.add_special_tokens,
        )
        kept = truncated_prompt(ids, body.truncate_prompt_tokens, router.model.max_model_len)
        text = rendered if len(kept) == len(ids) else None  # None: not the text that runs
        ids = kept
        names = body.field_names
        fields = body.sampling_fields(body.output_limit, body.num_logprobs)
        tools.constrain(fields, names)
        greq = _request(body, ids, text, fields, body.output_limit, names, request)
        batch = PromptBatch(router, [greq])
        fmt = OpenAIFormatter(
            label or greq.request_id,
            router.model.id,
            True,
            tokenizer,
            body.top_logprobs or 0,
            tool_call_parsers(tools),
            batch.prompt_ids if body.return_token_ids else None,
            body.return_tokens_as_token_ids,
        )
        return await _respond(request, body, batch, fmt, body.logprobs)


def response_label(http: Request, body: _Sampling) -> str | None:
    """The client's own id for the response (vLLM's: the X-Request-Id header, else the body's
    request_id), checked; never the request's key inside (router/types.py)."""
    header = http.headers.get("x-request-id")
    if header is not None:
        return client_label(header, "X-Request-Id")
    return client_label(body.request_id)


def _request(
    body: _Sampling,
    ids: list[int],
    text: str | None,
    fields: dict[str, Any],
    max_tokens: int | None,
    field_names: dict[str, str],
    http: Request,
) -> GenerateRequest:
    params = sampling_params(fields, field_names)
    if max_tokens is None:  # OpenAI's meaning: up to the context length
        params = dataclasses.replace(params, max_tokens=None)
    return GenerateRequest(
        new_request_id(),
        ids,
        params,
        body.model,
        text,
        body.include_stop_str_in_output,
        field_names=field_names,
        tenant=http.state.tenant,
        priority=body.priority,
    )


async def _respond(
    request: Request,
    body: _Sampling,
    batch: PromptBatch,
    fmt: OpenAIFormatter,
    want_logprobs: bool,
) -> Response:
    # Refuse bad input and overload with a status line, before any stream starts: every
    # prompt's request (structured-output constraint, then admission) or none.
    await batch.admit()
    chunks: AsyncIterator[GenerateChunk] = batch.chunks()
    if body.stream:
        running = batch.num_prompt_tokens if body.continuous_usage else None
        events = fmt.sse(chunks, body.include_usage, want_logprobs, running)
        return EventStreamResponse(events, on_close=batch.release)
    try:
        whole = await until_disconnected(
            request, fmt.whole(chunks, batch.num_choices, want_logprobs)
        )
    except ClientGoneError:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    finally:
        batch.release()
    return JSONResponse(batch.finish(whole, fmt.chat))
