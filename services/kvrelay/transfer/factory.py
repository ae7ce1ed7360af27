"""Pick a KV connector by name: "nixl", "grpc", or "auto" (NIXL when it imports, else gRPC;
gRPC whenever KV TLS is configured, since UCX has no TLS)."""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.transfer.base import KVConnector
from kvrelay.transfer.kv_secret import KVSecret
from kvrelay.transfer.network import KVNetwork
from kvrelay.transfer.nixl_api import nixl_available
from kvrelay.transfer.tls import KVTLS

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "grpc")

__all__ = ["BACKENDS", "create_connector", "nixl_available", "pick_backend"]


def pick_backend(backend: str, tls: KVTLS | None = None) -> str:
    """The backend a worker uses for `backend` ("auto" resolved): NIXL when it imports and
    no KV TLS is configured, else gRPC.

    Raises:
        ValueError: an unknown backend name, or "nixl" with KV TLS configured (UCX cannot
            encrypt; refusing beats moving KV in the clear that the operator asked to protect).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; choose one of {BACKENDS}")
    if tls is not None:
        if backend == "nixl":
            raise ValueError(
                "KV TLS is configured ($KVRELAY_KV_TLS_*) but the KV transfer backend is nixl, "
                "which has no TLS: use --transfer-backend grpc (or auto), or unset the TLS files"
            )
        return "grpc"
    if backend == "auto":
        return "nixl" if nixl_available() else "grpc"
    return backend


def create_connector(
    backend: str = "auto",
    *,
    secret: KVSecret | None = None,
    network: KVNetwork | None = None,
    serve: bool = True,
    **options: Any,
) -> KVConnector:
    """A new, unregistered connector; `options` go to its constructor (e.g. `timeout_s`).

    `secret`: the deployment's KV secret (gRPC proves and checks every pull with it; NIXL's
    one-sided READs need none). `network`: where its transport listens (default loopback).
    `serve`: whether peers pull from this worker (a decode worker: False, no gRPC server).
    With `network.tls` set the connector is gRPC over mTLS (see `pick_backend`).

    Raises:
        ValueError: an unknown backend name, or "nixl" with KV TLS configured.
        ImportError: "nixl" asked for explicitly but not installed.
    """
    tls = None if network is None else network.tls
    chosen = pick_backend(backend, tls)
    if chosen != backend:
        why = "KV TLS is configured" if tls is not None else "auto"
        logger.info("KV transfer backend: %s (%s)", chosen, why)
    backend = chosen
    if backend == "nixl":
        from kvrelay.transfer.nixl_api import load_nixl_api
        from kvrelay.transfer.nixl_connector import NixlConnector

        load_nixl_api()  # fail here, with the install hint, rather than at register()
        if network is not None:
            options.setdefault("net_devices", network.ucx_net_devices)
        return NixlConnector(**options)
    from kvrelay.transfer.grpc_connector import GrpcConnector

    if network is not None:
        options.setdefault("host", network.host)
        options.setdefault("advertise_host", network.advertise_host)
        options.setdefault("tls", network.tls)
    return GrpcConnector(secret=secret, serve=serve, **options)
