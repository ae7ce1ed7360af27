"""Pick a KV connector by name: "nixl", "grpc", or "auto" (NIXL when it imports, else gRPC)."""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.transfer.base import KVConnector
from kvrelay.transfer.nixl_api import nixl_available

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "grpc")

__all__ = ["BACKENDS", "create_connector", "nixl_available"]


def create_connector(backend: str = "auto", **options: Any) -> KVConnector:
    """A new, unregistered connector; `options` go to its constructor (e.g. `timeout_s`).

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
        return NixlConnector(**options)
    from kvrelay.transfer.grpc_connector import GrpcConnector

    return GrpcConnector(**options)
