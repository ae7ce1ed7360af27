"""The optional API key, checked the same way on HTTP and gRPC."""

from __future__ import annotations

import hmac

from kvrelay.router.errors import RouterError, Status


class AuthenticationError(RouterError):
    status = Status.UNAUTHENTICATED


def check_api_key(authorization: str, api_key: str | None, how_to_send: str) -> None:
    """Raise AuthenticationError unless `authorization` is "Bearer <api_key>" (no key set:
    everything passes). Constant-time compare, so the key cannot be guessed by timing."""
    if api_key is None:
        return
    given = authorization.removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise AuthenticationError(f"invalid or missing API key: send '{how_to_send}'")
