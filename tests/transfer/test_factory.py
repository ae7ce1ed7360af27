"""create_connector picks the backend by name; "auto" prefers NIXL when it imports."""

from __future__ import annotations

import pytest

from kvrelay.transfer.factory import create_connector, nixl_available
from kvrelay.transfer.grpc_connector import GrpcConnector


def test_named_backends() -> None:
    grpc_connector = create_connector("grpc", timeout_s=3.0)
    assert isinstance(grpc_connector, GrpcConnector) and grpc_connector.timeout_s == 3.0
    if nixl_available():
        from kvrelay.transfer.nixl_connector import NixlConnector

        assert isinstance(create_connector("nixl"), NixlConnector)
        assert isinstance(create_connector(), NixlConnector)
    else:
        assert isinstance(create_connector(), GrpcConnector)
        with pytest.raises(ImportError, match="pip install nixl-cu12"):
            create_connector("nixl")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        create_connector("rdma")
