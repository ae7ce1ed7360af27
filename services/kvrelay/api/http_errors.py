"""Every HTTP error in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
our own refusals, body validation, bodies that are not JSON (or not UTF-8, or nested too
deep), unknown routes and methods, and, last, anything unexpected (a 500 that says nothing
about internals; the traceback goes to the log)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kvrelay.api.openai_format import error_body, router_error_body
from kvrelay.router.request_errors import OverloadedError, RouterError

logger = logging.getLogger(__name__)

# Names pydantic puts in an error's location for the member of a union it tried ("str",
# "list[int]"): not fields of the request.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RouterError, _router_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


def error_response(
    body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> Response:
    """A JSON error; text the client sent back to it (a lone surrogate) cannot break it."""
    error = body["error"]
    error["message"] = _printable(error["message"])
    if error.get("param") is not None:
        error["param"] = _printable(error["param"])
    return JSONResponse(body, status, headers=headers)


async def _router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    headers = {}
    if isinstance(exc, OverloadedError):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return error_response(router_error_body(exc), exc.status.http_status, headers)


async def _invalid_body(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = _param(first.get("loc", ()))
    message = str(first.get("msg", "invalid request body"))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        message, param = f"the body is not valid JSON: {detail}", None
    elif param:
        message = f"{param}: {message}"
    else:
        message = f"the body must be a JSON object of the request's fields: {message}"
    return error_response(error_body(message, "invalid_request_error", 400, param), 400)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status == 400:  # FastAPI's own: the body could not be read as JSON at all
        message = "the body is not valid JSON (or not UTF-8 text, or nested too deeply)"
    elif status == 404:
        message = f"there is no route {request.url.path}: see /v1/models, /v1/completions, ..."
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    error_type = "authentication_error" if status == 401 else "invalid_request_error"
    body = error_body(message, error_type, status)
    return error_response(body, status, dict(exc.headers or {}))


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    message = "the server failed this request; it has been logged"
    return error_response(error_body(message, "internal_error", 500), 500)


def _param(loc: Any) -> str | None:
    """The dotted field path of a validation error's location ("messages.0.role")."""
    parts = [str(part) for part in loc if part != "body"]
    kept = [p for p in parts if p.lower() not in _TYPE_TAGS and "[" not in p and "-" not in p]
    return ".".join(kept) or None


def _printable(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
