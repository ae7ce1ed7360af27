"""Mutual TLS for the KV gRPC channel between workers, configured from each worker's
environment (a Kubernetes pod mounts a Secret and names its files). No sockets here: the
gRPC server and connector ask this module for their credentials.

With TLS on, a worker's KV server accepts only clients presenting a certificate that the
deployment's CA signed, and a puller talks only to servers whose certificate that CA signed.
The HMAC pull proof (transfer/kv_secret.py) still guards every pull: TLS says who may connect and
keeps the bytes private on the wire; the proof says what a connected engine may read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvrelay.common.env import KV_TLS_CA, KV_TLS_CERT, KV_TLS_KEY, KV_TLS_SERVER_NAME

KV_TLS_CERT_ENV = KV_TLS_CERT.name  # this worker's certificate (chain), PEM
KV_TLS_KEY_ENV = KV_TLS_KEY.name  # its private key, PEM
KV_TLS_CA_ENV = KV_TLS_CA.name  # the CA that signs every worker's certificate, PEM
# The name a puller checks in the server's certificate, when certificates are not issued for
# the addresses peers dial (pod IPs): e.g. one certificate for "kvrelay-kv" shared by the pool.
KV_TLS_SERVER_NAME_ENV = KV_TLS_SERVER_NAME.name
_FILES = (KV_TLS_CERT_ENV, KV_TLS_KEY_ENV, KV_TLS_CA_ENV)


class KVTLSError(ValueError):
    """The KV channel's TLS settings are incomplete or their files cannot be read."""


@dataclass(frozen=True)
class KVTLS:
    """One worker's mTLS material for the KV channel, read once at start (a missing file
    fails the worker then, with its name, not at the first pull). The same certificate serves
    as this worker's server and client identity, so it needs both extended key usages
    (serverAuth, clientAuth) when it restricts them. Its repr shows no key material."""

    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    root_certs: bytes = field(repr=False)
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        cert: str | Path,
        key: str | Path,
        ca: str | Path,
        server_name: str | None = None,
    ) -> KVTLS:
        """Read the PEM files.

        Raises:
            KVTLSError: a file cannot be read or holds no PEM block.
        """
        return cls(
            _read(cert, KV_TLS_CERT_ENV),
            _read(key, KV_TLS_KEY_ENV),
            _read(ca, KV_TLS_CA_ENV),
            server_name or None,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVTLS | None:
        """The files named by $KVRELAY_KV_TLS_CERT, _KEY and _CA (all three, or none: None,
        plaintext) and $KVRELAY_KV_TLS_SERVER_NAME.

        Raises:
            KVTLSError: some but not all of the three are set, or a file cannot be read.
        """
        env = os.environ if environ is None else environ
        paths = {var.name: var.get(env).strip() for var in (KV_TLS_CERT, KV_TLS_KEY, KV_TLS_CA)}
        server_name = KV_TLS_SERVER_NAME.get(env).strip() or None
        missing = [name for name, path in paths.items() if not path]
        if len(missing) == len(_FILES):
            if server_name is not None:
                raise KVTLSError(
                    f"${KV_TLS_SERVER_NAME_ENV} is set but KV TLS is off: set "
                    f"${KV_TLS_CERT_ENV}, ${KV_TLS_KEY_ENV} and ${KV_TLS_CA_ENV} too, or unset it"
                )
            return None
        if missing:
            raise KVTLSError(
                "KV TLS needs all of $" + ", $".join(_FILES) + "; missing: $" + ", $".join(missing)
            )
        return cls.from_files(
            paths[KV_TLS_CERT_ENV], paths[KV_TLS_KEY_ENV], paths[KV_TLS_CA_ENV], server_name
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """The KV server's side: presents this worker's certificate and requires a client
        certificate signed by the CA (a client without one fails the handshake)."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.root_certs,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A puller's side: verifies the server against the CA, presents this worker's
        certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certs,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """The name checked in the server's certificate, when it is not the dialed host."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise KVTLSError(f"cannot read {path} (${what}): {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise KVTLSError(f"{path} (${what}) holds no PEM block")
    return data
