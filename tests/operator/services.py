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


def cluster_of(spec: dict[str, Any] | None = None) -> str:
    """The RayCluster name of the revision `spec` makes (a service named demo)."""
    from kvrelay_operator.names import raycluster_name
    from kvrelay_operator.revision import revision_hash

    return raycluster_name("demo", revision_hash(service(spec or {})))


def worker_pod(
    name: str, pool: str, cluster: str, ready: bool = True, created: str = "", **meta: Any
) -> dict[str, Any]:
    """A Ray worker pod as KubeRay labels it."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "metadata": {
            "name": name,
            "labels": {"ray.io/cluster": cluster, "ray.io/group": pool},
            "creationTimestamp": created,
            **meta,
        },
        "status": {"phase": "Running", "conditions": conditions},
    }
