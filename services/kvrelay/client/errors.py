"""Typed exceptions of the kvrelay client SDK, mapped from gRPC status codes.

Callers catch these instead of `grpc.RpcError`; this module only maps, it never retries.
"""

from __future__ import annotations

import math

import grpc

__all__ = [
    "AuthenticationError",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "KVRelayError",
    "NotFoundError",
    "OverloadedError",
    "RequestCancelledError",
    "UnavailableError",
    "error_from_status",
    "from_rpc_error",
    "parse_retry_after",
]

RETRY_AFTER_KEY = "retry-after"


class KVRelayError(Exception):
    """A failed kvrelay call: `code` is the gRPC status (None for client-side failures)."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details if code is None else f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgumentError(KVRelayError):
    """The request was malformed; the message names the offending field."""


class NotFoundError(KVRelayError):
    """The named model (or another resource) does not exist on the server."""


class OverloadedError(KVRelayError):
    """The server is full (RESOURCE_EXHAUSTED); `retry_after` is its hint in seconds, if any."""

    def __init__(
        self,
        details: str,
        code: grpc.StatusCode | None = grpc.StatusCode.RESOURCE_EXHAUSTED,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(details, code)
        self.retry_after = retry_after


class UnavailableError(KVRelayError):
    """No server or worker could take the request (unreachable, draining, empty pool)."""


class DeadlineExceededError(KVRelayError):
    """The call's deadline passed before it finished."""


class AuthenticationError(KVRelayError):
    """The API key is missing, wrong, or not allowed to do this."""


class RequestCancelledError(KVRelayError):
    """The call was cancelled (by this client or the server).

    Not named `CancelledError` so that it is never confused with `asyncio.CancelledError`.
    """


class InternalError(KVRelayError):
    """The server failed (INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED)."""


_BY_CODE: dict[grpc.StatusCode, type[KVRelayError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
    grpc.StatusCode.UNIMPLEMENTED: InternalError,
}


def parse_retry_after(metadata: object) -> float | None:
    """The `retry-after` value (seconds, >= 0) in gRPC metadata, or None if absent or garbled.

    `metadata` is what `Call.trailing_metadata()` returns: a sequence of (key, value) pairs
    (sync) or a `grpc.aio.Metadata` (async); both iterate as pairs.
    """
    if not metadata:
        return None
    try:
        pairs = list(metadata)  # type: ignore[call-overload]
    except TypeError:
        return None
    for pair in pairs:
        key, value = pair[0], pair[1]
        if str(key).lower() != RETRY_AFTER_KEY:
            continue
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        try:
            seconds = float(value)
        except ValueError:
            return None
        # A negative, NaN or infinite hint is the server's bug; ignore it rather than obey it.
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    return None


def error_from_status(
    code: grpc.StatusCode, details: str, retry_after: float | None = None
) -> KVRelayError:
    """The typed exception for one gRPC status."""
    cls = _BY_CODE.get(code, KVRelayError)
    if cls is OverloadedError:
        return OverloadedError(details, code, retry_after=retry_after)
    return cls(details, code)


def from_rpc_error(error: grpc.RpcError) -> KVRelayError:
    """Map a `grpc.RpcError` (sync or `grpc.aio.AioRpcError`) to its typed exception."""
    # Sync call errors are also `grpc.Call`s; aio errors have the same accessors.
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    trailing_fn = getattr(error, "trailing_metadata", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = (details_fn() if callable(details_fn) else None) or str(error)
    trailing = trailing_fn() if callable(trailing_fn) else None
    return error_from_status(code, details, parse_retry_after(trailing))
