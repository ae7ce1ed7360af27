"""Settings shared by the sync and asyncio clients: target, credentials, deadline, retries."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import grpc

from kvrelay.client.retry import Deadline, RetryHook, RetryPolicy
from kvrelay.common.env import API_KEY

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_TARGET",
    "ClientOptions",
    "resolve_api_key",
    "tls_credentials",
]

API_KEY_ENV = API_KEY.name
DEFAULT_TARGET = "127.0.0.1:50051"


def resolve_api_key(api_key: str | None) -> str | None:
    """The explicit key, else `$KVRELAY_API_KEY`, else None (no authorization metadata)."""
    if api_key is not None:
        return api_key or None
    return API_KEY.get() or None


def tls_credentials(
    ca_certs: str | os.PathLike[str] | None = None,
    client_cert: str | os.PathLike[str] | None = None,
    client_key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: `ca_certs` is the bundle the server's
    certificate is checked against (None: the system's roots); `client_cert` and `client_key`
    (both or neither) are presented to a server that requires client certificates (mTLS).

    Raises:
        ValueError: only one of client_cert / client_key, or a file that cannot be read.
    """
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together (a certificate and its key)")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_certs),
        private_key=_read(client_key),
        certificate_chain=_read(client_cert),
    )


def _read(path: str | os.PathLike[str] | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ValueError(f"cannot read {os.fspath(path)!r}: {exc.strerror}") from None


@dataclass(frozen=True)
class ClientOptions:
    target: str = DEFAULT_TARGET
    api_key: str | None = None
    timeout: float | None = None  # default per-call deadline in seconds; None: no deadline
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    on_retry: RetryHook | None = None
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext (loopback, in-mesh)
    channel_options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {self.timeout}")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.api_key is None else (("authorization", f"Bearer {self.api_key}"),)

    def deadline(self, timeout: float | None) -> Deadline:
        """The deadline of one call: its own `timeout` if given, else the client's default."""
        return Deadline(self.timeout if timeout is None else timeout)


def build_options(
    target: str,
    *,
    api_key: str | None,
    timeout: float | None,
    max_retries: int | None,
    retry_policy: RetryPolicy | None,
    on_retry: RetryHook | None,
    credentials: grpc.ChannelCredentials | None,
    channel_options: tuple[tuple[str, object], ...],
    ca_certs: str | os.PathLike[str] | None = None,
    client_cert: str | os.PathLike[str] | None = None,
    client_key: str | os.PathLike[str] | None = None,
) -> ClientOptions:
    """The constructor arguments of either client -> ClientOptions (max_retries overrides the
    policy's count, so the common case needs no RetryPolicy; the PEM file arguments become
    TLS `credentials`)."""
    if ca_certs is not None or client_cert is not None or client_key is not None:
        if credentials is not None:
            raise ValueError("pass either credentials or ca_certs / client_cert / client_key")
        credentials = tls_credentials(ca_certs, client_cert, client_key)
    policy = retry_policy or RetryPolicy()
    if max_retries is not None:
        policy = replace(policy, max_retries=max_retries)
    return ClientOptions(
        target=target,
        api_key=resolve_api_key(api_key),
        timeout=timeout,
        retry=policy,
        on_retry=on_retry,
        credentials=credentials,
        channel_options=channel_options,
    )
