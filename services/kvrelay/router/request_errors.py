"""Why the router refused or failed a request, independent of the wire.

Each error names its status once; the gRPC and HTTP layers translate (docs/architecture.md
section 3: INVALID_ARGUMENT / 400, RESOURCE_EXHAUSTED / 429, UNAVAILABLE / 503,
DEADLINE_EXCEEDED / 504).
"""

from __future__ import annotations

from enum import Enum


class Status(Enum):
    """(gRPC status name, HTTP status, OpenAI error type)."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error")
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error")
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error")
    UNAVAILABLE = ("UNAVAILABLE", 503, "service_unavailable")
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout")
    INTERNAL = ("INTERNAL", 500, "internal_error")

    @property
    def grpc_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def error_type(self) -> str:
        return self.value[2]


class RouterError(Exception):
    status = Status.INTERNAL

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when there is one


class InvalidRequestError(RouterError):
    status = Status.INVALID_ARGUMENT


class ModelNotFoundError(RouterError):
    """An unknown model is bad input (400 / INVALID_ARGUMENT, param "model")."""

    status = Status.INVALID_ARGUMENT

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(
            f"the model {model!r} does not exist here; served: {', '.join(served)}", "model"
        )


class OverloadedError(RouterError):
    status = Status.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(RouterError):
    status = Status.UNAVAILABLE


class DeadlineExceededError(RouterError):
    status = Status.DEADLINE_EXCEEDED
