"""Observed children -> a service's status and conditions, and each pool's status.

Pure: the kopf layer reads pods, the RayCluster and the Deployment, condenses them into an
`Observed`, and writes back what `service_status` returns. A condition's
lastTransitionTime moves only when its status changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.names import POOLS, pool_selector
from kvrelay_operator.podparts import Obj
from kvrelay_operator.router_deployment import endpoint
from kvrelay_operator.spec import ServiceSpec

CONDITION_TYPES = ("Ready", "PrefillReady", "DecodeReady", "RouterReady")


@dataclass(frozen=True)
class Counts:
    """Pods (or replicas) wanted, existing and ready."""

    desired: int = 0
    current: int = 0
    ready: int = 0


@dataclass(frozen=True)
class Observed:
    """What the kopf layer saw of a service's children."""

    raycluster_exists: bool = False
    pools: Mapping[str, Counts] = field(default_factory=dict)
    router_exists: bool = False
    router: Counts = field(default_factory=Counts)
    load_balancer_host: str = ""
    # Set when this reconcile failed: (CamelCase reason, message).
    error: tuple[str, str] | None = None


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def _pod_alive(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def count_pods(pods: Iterable[Mapping[str, Any]], desired: int) -> Counts:
    """Condense one pool's worker pods into counts."""
    alive = [p for p in pods if _pod_alive(p)]
    return Counts(desired=desired, current=len(alive), ready=sum(_pod_ready(p) for p in alive))


def _condition(type_: str, ok: bool, reason: str, message: str) -> Obj:
    status = "True" if ok else "False"
    return {"type": type_, "status": status, "reason": reason, "message": message}


def _pool_condition(pool: str, observed: Observed) -> Obj:
    type_ = f"{pool.capitalize()}Ready"
    if not observed.raycluster_exists:
        return _condition(type_, False, "RayClusterMissing", "the RayCluster does not exist yet")
    counts = observed.pools.get(pool, Counts())
    summary = f"{counts.ready}/{counts.desired} {pool} workers ready"
    if counts.desired == 0:
        # Prefill may be empty: decode workers then run whole requests. Decode may not.
        if pool == "prefill":
            return _condition(type_, True, "ScaledToZero", "no prefill workers: decode-only")
        return _condition(type_, False, "ScaledToZero", "no decode workers: nothing can serve")
    if counts.ready >= counts.desired:
        return _condition(type_, True, "WorkersReady", summary)
    return _condition(type_, False, "WorkersNotReady", summary)


def _router_condition(observed: Observed) -> Obj:
    if not observed.router_exists:
        return _condition("RouterReady", False, "DeploymentMissing", "no router Deployment yet")
    r = observed.router
    summary = f"{r.ready}/{r.desired} routers ready"
    if r.ready >= max(r.desired, 1):
        return _condition("RouterReady", True, "RoutersReady", summary)
    return _condition("RouterReady", False, "RoutersNotReady", summary)


def _ready_condition(parts: Sequence[Obj], observed: Observed) -> Obj:
    if observed.error is not None:
        reason, message = observed.error
        return _condition("Ready", False, reason, message)
    waiting = [f"{c['type']} ({c['message']})" for c in parts if c["status"] != "True"]
    if waiting:
        return _condition("Ready", False, "ComponentsNotReady", "waiting for " + ", ".join(waiting))
    return _condition("Ready", True, "AllReady", "serving")


def merge_conditions(
    previous: Iterable[Mapping[str, Any]], new: Iterable[Obj], generation: int, now: str
) -> list[Obj]:
    """Stamp `new` conditions, keeping a previous lastTransitionTime when the status held."""
    old = {c.get("type"): c for c in previous}
    out = []
    for cond in new:
        before = old.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamped = dict(cond)
        stamped["lastTransitionTime"] = (
            str(before.get("lastTransitionTime", now)) if before is not None and same else now
        )
        stamped["observedGeneration"] = generation
        out.append(stamped)
    return out


def service_status(
    spec: ServiceSpec,
    observed: Observed,
    previous: Mapping[str, Any],
    now: str,
    extra: Sequence[Obj] = (),
) -> Obj:
    """The status to write on the service.

    Args:
        spec: the parsed service.
        observed: its children as seen now.
        previous: the status it has now (conditions keep their transition times).
        now: an RFC 3339 timestamp for conditions that change.
        extra: more conditions (a Rolling upgrade's Progressing, rollout.py).
    """
    pools = [_pool_condition(pool, observed) for pool in POOLS]
    router = _router_condition(observed)
    parts = [*pools, router]
    conditions = merge_conditions(
        previous.get("conditions") or (),
        [_ready_condition(parts, observed), *parts, *extra],
        spec.generation,
        now,
    )
    status: Obj = {"observedGeneration": spec.generation, "conditions": conditions}
    for pool in POOLS:
        counts = observed.pools.get(pool, Counts())
        status[pool] = {"replicas": counts.desired, "readyReplicas": counts.ready}
    status["router"] = {"replicas": observed.router.desired, "readyReplicas": observed.router.ready}
    status["endpoint"] = endpoint(spec, observed.load_balancer_host)
    return status


def pool_status(spec: ServiceSpec, pool: str, revision: str, counts: Counts) -> Obj:
    """A KVRelayPool's status: what the scale subresource and `kubectl get` show (the
    serving revision's pods)."""
    return {
        "replicas": counts.current,
        "readyReplicas": counts.ready,
        "selector": pool_selector(spec.name, pool, revision),
    }


def load_balancer_host(service: Mapping[str, Any] | None) -> str:
    """The first ingress host or IP of a LoadBalancer Service, or ""."""
    if not service:
        return ""
    ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    for entry in ingress:
        host = entry.get("hostname") or entry.get("ip")
        if host:
            return str(host)
    return ""
