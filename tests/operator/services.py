"""KVRelayService bodies for the operator tests, defaulted the way the API server would."""

from __future__ import annotations

from typing import Any

from kvrelay_operator.spec import ServiceSpec, parse_service
from tests.deploy.schemas import validate_custom

IMAGE = "registry.example/kvrelay:0.1.0"


def service_body(
    spec: dict[str, Any] | None = None,
    name: str = "demo",
    generation: int = 1,
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A KVRelayService as read from the API: CRD defaults applied and validated."""
    body: dict[str, Any] = {
        "apiVersion": "kvrelay.io/v1alpha1",
        "kind": "KVRelayService",
        "metadata": {"name": name, "namespace": "llm", "uid": "uid-1234", "generation": generation},
        "spec": spec or {},
    }
    if status is not None:
        body["status"] = status
    return validate_custom(body)


def service(spec: dict[str, Any] | None = None, **kwargs: Any) -> ServiceSpec:
    return parse_service(service_body(spec, **kwargs), IMAGE)
