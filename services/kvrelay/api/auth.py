"""The optional API key, checked the same way on HTTP and gRPC."""

from __future__ import annotations

import hmac

from kvrelay.router.request_errors import RouterError, Status


class AuthenticationError(RouterError):
    status = Status.UNAUTHENTICATED


def check_api_key(authorization: str, api_key: str | None, how_to_send: str) -> None:
    """Raise AuthenticationError unless `authorization` is "Bearer <api_key>" (no key set:
    everything passes).

    The scheme must be there: a bare key ("Authorization: secret") is refused, as vLLM and
    RFC 6750 do. The scheme's name is compared case-insensitively (RFC 7235 s. 2.1), the key
    exactly (no trimming) and in constant time, so it cannot be guessed by timing."""
    if api_key is None:
        return
    scheme, _, given = authorization.partition(" ")
    bearer = scheme.lower() == "bearer"
    # Compare even when the scheme is wrong, so both failures take the same time.
    matches = hmac.compare_digest(given.encode(), api_key.encode())
    if not (bearer and matches):
        raise AuthenticationError(f"invalid or missing API key: send '{how_to_send}'")
