"""A small typed client over the `kubernetes` package for the few calls the operator makes.

Objects stay plain dicts (what `desired.py` builds); every write of a child is a
server-side apply under one field manager. API failures surface as `RetryableError` or
`PermanentError`, never as the client's own exceptions.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping
from typing import Any

from kvrelay_operator.errors import PermanentError, RetryableError, classify_api_error
from kvrelay_operator.names import FIELD_MANAGER

# Kind -> plural of every kind the operator touches; RBAC in the chart grants exactly these.
PLURALS = {
    "KVRelayService": "kvrelayservices",
    "KVRelayPool": "kvrelaypools",
    "RayCluster": "rayclusters",
    "Deployment": "deployments",
    "Service": "services",
    "Pod": "pods",
    "Secret": "secrets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "ServiceMonitor": "servicemonitors",
    "Event": "events",  # a Rolling upgrade past its deadline (rollout.py)
    "Job": "jobs",  # the shared model cache's filler (model_cache.py)
    "PersistentVolumeClaim": "persistentvolumeclaims",
}


def resource_path(
    api_version: str, kind: str, namespace: str, name: str = "", subresource: str = ""
) -> str:
    """The REST path of a namespaced collection, object or subresource."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class Kube:
    """Synchronous calls; kopf runs sync handlers in a thread pool."""

    def __init__(self, api_client: Any) -> None:
        self._api = api_client

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        """One request; None for 404 on a read, a typed error for any other failure."""
        import urllib3

        headers = {"Content-Type": content_type, "Accept": "application/json"}
        try:
            request = self._api.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(*request, _request_timeout=30)
            response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise RetryableError(f"{method} {path}: {exc}") from exc
        if response.status == 404 and method in ("GET", "DELETE"):
            return None
        if not 200 <= response.status < 300:
            reason = response.data.decode(errors="replace")[:300] if response.data else ""
            raise classify_api_error(response.status, f"{method} {path}: {reason}")
        parsed: dict[str, Any] = json.loads(response.data) if response.data else {}
        return parsed

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call("GET", resource_path(api_version, kind, namespace, name))

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        path = resource_path(api_version, kind, namespace)
        result = self._call("GET", path, query=[("labelSelector", selector)])
        return list((result or {}).get("items") or [])

    def list_everywhere(
        self, api_version: str, kind: str, namespaces: tuple[str, ...] | None
    ) -> builtins.list[dict[str, Any]]:
        """Every object of `kind` in `namespaces`, or in all namespaces where None (an
        operator run with --all-namespaces, whose RBAC lists cluster-wide)."""
        if namespaces is not None:
            return [obj for ns in namespaces for obj in self.list(api_version, kind, ns, "")]
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        result = self._call("GET", f"{root}/{PLURALS[kind]}")
        return list((result or {}).get("items") or [])

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply; `force` because the operator is the authority on these fields."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        result = self._call("PATCH", path, obj, query, "application/apply-patch+yaml")
        if result is None:
            raise PermanentError(f"apply {path} returned nothing")
        return result

    def apply_cluster(self, obj: Mapping[str, Any], api_version: str, plural: str) -> None:
        """Server-side apply a cluster-scoped object (a CRD, from the upgrade hook)."""
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        path = f"{root}/{plural}/{obj['metadata']['name']}"
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        self._call("PATCH", path, obj, query, "application/apply-patch+yaml")

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create `obj`; None if it already exists (a racing reconcile created it)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        try:
            return self._call("POST", path, obj, [("fieldManager", FIELD_MANAGER)])
        except RetryableError as exc:
            if exc.status == 409:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._call("DELETE", resource_path(api_version, kind, namespace, name))

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        path = resource_path(api_version, kind, namespace, name, "status")
        self._call("PATCH", path, {"status": status}, None, "application/merge-patch+json")

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set replicas through the scale subresource, as an HPA would."""
        path = resource_path(api_version, kind, namespace, name, "scale")
        body = {"spec": {"replicas": replicas}}
        self._call("PATCH", path, body, None, "application/merge-patch+json")
