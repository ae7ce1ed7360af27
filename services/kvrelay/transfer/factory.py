"""Pick a KV connector by name: "nixl", "grpc", or "auto" (NIXL when it imports, else gRPC)."""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.transfer.auth import KVSecret
from kvrelay.transfer.base import KVConnector
from kvrelay.transfer.network import KVNetwork
from kvrelay.transfer.nixl_api import nixl_available

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "grpc")

__all__ = ["BACKENDS", "create_connector", "nixl_available"]


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

    Raises:
        ValueError: an unknown backend name.
        ImportError: "nixl" asked for explicitly but not installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = "nixl" if nixl_available() else "grpc"
        logger.info("KV transfer backend: %s (auto)", backend)
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
    return GrpcConnector(secret=secret, serve=serve, **options)
