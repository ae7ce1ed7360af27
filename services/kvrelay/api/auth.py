"""The API keys, checked the same way on HTTP and gRPC, and the tenant a request belongs to:
the tenant whose key it sent (keys listed in --tenant-limits), or the value of the header the
operator named with --tenant-header, or "default". Never decides limits (tenant_limits.py)."""

from __future__ import annotations

import hmac

from kvrelay.router.request_errors import InvalidRequestError, RouterError, Status
from kvrelay.router.tenant_limits import DEFAULT_TENANT, MAX_TENANT_NAME, TenantBook, tenant_of_key


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


def key_tenant(
    authorization: str, api_key: str | None, keys: dict[str, str], how_to_send: str
) -> str:
    """The tenant of the key sent: a key listed in --tenant-limits is its tenant's, --api-key
    is "default". With neither configured every request is "default"; with either, a request
    without one of them is refused (AuthenticationError), as check_api_key refuses."""
    if not keys:
        check_api_key(authorization, api_key, how_to_send)
        return DEFAULT_TENANT
    scheme, _, given = authorization.partition(" ")
    bearer = scheme.lower() == "bearer"
    listed = tenant_of_key(keys, given)  # every key compared, in constant time
    operator = api_key is not None and hmac.compare_digest(given.encode(), api_key.encode())
    if bearer and listed is not None:
        return listed
    if bearer and operator:
        return DEFAULT_TENANT
    raise AuthenticationError(f"invalid or missing API key: send '{how_to_send}'")


def header_tenant(value: str | None, header: str) -> str | None:
    """The tenant a --tenant-header value names (None: absent or empty); a value that is
    too long or not printable is refused naming the header, never truncated."""
    if not value:
        return None
    if len(value) > MAX_TENANT_NAME or not value.isprintable():
        raise InvalidRequestError(
            f"the {header} header must be 1-{MAX_TENANT_NAME} printable characters", header
        )
    return value


def request_tenant(
    book: TenantBook,
    api_key: str | None,
    authorization: str,
    header_value: str | None,
    how_to_send: str,
) -> str:
    """Authenticate, then name the tenant: the --tenant-header value when the operator named
    one and the request carries it, else the key's tenant."""
    tenant = key_tenant(authorization, api_key, book.keys, how_to_send)
    if book.tenant_header is not None:
        return header_tenant(header_value, book.tenant_header) or tenant
    return tenant
