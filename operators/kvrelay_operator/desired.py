"""A service's desired children, owner references set: what reconciliation applies.

`desired_objects` is pure: the same spec and pool sizes give the same objects, so a
reconcile is "apply all of these" and a spec change shows as the objects that differ
(`changed_objects`).
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping, Sequence

from kvrelay_operator.names import (
    API_VERSION,
    KV_SECRET_KEY,
    POOL_KIND,
    POOLS,
    SERVICE_KIND,
    kv_secret_name,
    labels,
    pdb_name,
    pool_name,
    router_name,
    selector_labels,
)
from kvrelay_operator.podparts import Obj, model_cache_objects
from kvrelay_operator.ray_access import desired_ray_network_policy
from kvrelay_operator.raycluster import desired_raycluster
from kvrelay_operator.revision import revision_hash
from kvrelay_operator.router_deployment import desired_router_deployment, desired_router_service
from kvrelay_operator.spec import ServiceSpec

ObjectKey = tuple[str, str, str]  # (apiVersion, kind, name); all children share a namespace


def object_key(obj: Mapping[str, object]) -> ObjectKey:
    meta = obj["metadata"]
    assert isinstance(meta, Mapping)
    return (str(obj["apiVersion"]), str(obj["kind"]), str(meta["name"]))


def owner_reference(spec: ServiceSpec) -> Obj:
    """The service owns every child: deleting it deletes them (garbage collection), with no
    finalizer that needs the operator. blockOwnerDeletion needs `update` on
    kvrelayservices/finalizers where OwnerReferencesPermissionEnforcement is on (the chart's
    RBAC grants it)."""
    return {
        "apiVersion": API_VERSION,
        "kind": SERVICE_KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pool_replicas(spec: ServiceSpec, observed: Mapping[str, int | None]) -> dict[str, int]:
    """Each pool's size: its KVRelayPool's `spec.replicas` once it exists (HPA, KEDA, the
    planner or a person may have scaled it), else the service's initial count."""
    out = {}
    for pool in POOLS:
        current = observed.get(pool)
        out[pool] = spec.pool(pool).replicas if current is None else current
    return out


def desired_pool(spec: ServiceSpec, pool: str, replicas: int) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": POOL_KIND,
        "metadata": {
            "name": pool_name(spec.name, pool),
            "namespace": spec.namespace,
            "labels": labels(spec.name, pool),
        },
        "spec": {"service": spec.name, "pool": pool, "replicas": replicas},
    }


def _pdb(spec: ServiceSpec, component: str, match: Mapping[str, str]) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": pdb_name(spec.name, component),
            "namespace": spec.namespace,
            "labels": labels(spec.name, component),
        },
        # One pod at a time: a drained node never takes a whole pool (or all routers) away.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(match)}},
    }


def desired_pdbs(spec: ServiceSpec) -> list[Obj]:
    """One per component; a pool's spans its revisions (a blue/green upgrade has two)."""
    return [_pdb(spec, c, selector_labels(spec.name, c)) for c in ("router", *POOLS)]


def generated_secret(spec: ServiceSpec, name: str, component: str, key: str, value: bytes) -> Obj:
    """A Secret the operator generates once for the service (owned by it, so deleted with
    it): one data `key` holding `value`."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": spec.namespace,
            "labels": labels(spec.name, component),
            "ownerReferences": [owner_reference(spec)],
        },
        "type": "Opaque",
        "data": {key: base64.b64encode(value).decode()},
    }


def desired_kv_secret(spec: ServiceSpec, key: bytes) -> Obj:
    """The KV transfer Secret the operator creates once (never applied again: the key must
    not change under running workers) when the service names none of its own."""
    return generated_secret(spec, kv_secret_name(spec.name), "kv", KV_SECRET_KEY, key)


def desired_service_monitor(spec: ServiceSpec) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {
            "name": router_name(spec.name),
            "namespace": spec.namespace,
            "labels": {**labels(spec.name, "router"), **spec.service_monitor_labels},
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(spec.name, "router")},
            "endpoints": [
                {"port": "http", "path": "/metrics", "interval": spec.service_monitor_interval}
            ],
        },
    }


def desired_objects(
    spec: ServiceSpec,
    observed_pools: Mapping[str, int | None],
    group_sizes: Mapping[str, int] | None = None,
    workers_to_delete: Mapping[str, Sequence[str]] | None = None,
) -> list[Obj]:
    """Every child of the service, in apply order, each owned by the service.

    Args:
        spec: the parsed service.
        observed_pools: pool -> its KVRelayPool's `spec.replicas`, None when it does not
            exist yet.
        group_sizes: pool -> the worker group's replicas when it differs from the pool's
            (a shrink waiting for its drain keeps the group at its size); default: the pool's.
        workers_to_delete: pool -> the drained pods a shrink removes.
    """
    sizes = pool_replicas(spec, observed_pools)
    revision = revision_hash(spec)
    objects = [desired_pool(spec, pool, sizes[pool]) for pool in POOLS]
    objects.extend(model_cache_objects(spec))  # the shared model cache's claim and Job
    groups = {**sizes, **(group_sizes or {})}
    objects.append(desired_raycluster(spec, revision, groups, workers_to_delete))
    objects.append(desired_ray_network_policy(spec))
    objects.append(desired_router_deployment(spec, revision))
    objects.append(desired_router_service(spec))
    objects.extend(desired_pdbs(spec))
    if spec.service_monitor:
        objects.append(desired_service_monitor(spec))
    for obj in objects:
        obj["metadata"]["ownerReferences"] = [owner_reference(spec)]
    return objects


def stale_kinds(spec: ServiceSpec) -> list[tuple[str, str, str]]:
    """Optional children the spec no longer wants, to delete: (apiVersion, kind, name)."""
    if spec.service_monitor:
        return []
    return [("monitoring.coreos.com/v1", "ServiceMonitor", router_name(spec.name))]


def apply_body(obj: Obj) -> Obj:
    """What server-side apply sends for `obj`.

    A KVRelayPool's `spec.replicas` is set when the pool is created and never applied again:
    whoever scales the pool (HPA, KEDA, the planner, kubectl scale) owns that field, and
    applying it would fight them.
    """
    if obj["kind"] != POOL_KIND:
        return obj
    body = copy.deepcopy(obj)
    del body["spec"]["replicas"]
    return body


def changed_objects(before: Sequence[Obj], after: Sequence[Obj]) -> list[ObjectKey]:
    """Keys of the objects that are new, gone or different between two desired sets."""
    old = {object_key(o): o for o in before}
    new = {object_key(o): o for o in after}
    keys = sorted(old.keys() | new.keys())
    return [k for k in keys if old.get(k) != new.get(k)]
