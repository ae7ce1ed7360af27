"""One level-based reconcile of a KVRelayService: apply every desired child, read them
back, write the status. The same steps run on create, update, resume and every resync tick,
so a missed event costs nothing but a delay.

The decisions are in the pure modules (`desired`, `status`); this file only sequences the
API calls around them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvrelay_operator.desired import apply_body, desired_objects, stale_kinds
from kvrelay_operator.errors import PermanentError, RetryableError, SpecError
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import (
    API_VERSION,
    POOL_KIND,
    POOLS,
    SERVICE_KIND,
    pool_name,
    pool_selector,
    raycluster_name,
    router_name,
)
from kvrelay_operator.spec import ServiceSpec, parse_service
from kvrelay_operator.status import (
    Counts,
    Observed,
    count_pods,
    load_balancer_host,
    merge_conditions,
    pool_status,
    service_status,
)

log = logging.getLogger(__name__)


def observed_pool_replicas(kube: Kube, spec: ServiceSpec) -> dict[str, int | None]:
    """Each pool's KVRelayPool `spec.replicas`, None where the pool does not exist yet."""
    out: dict[str, int | None] = {}
    for pool in POOLS:
        obj = kube.get(API_VERSION, POOL_KIND, spec.namespace, pool_name(spec.name, pool))
        out[pool] = None if obj is None else int((obj.get("spec") or {}).get("replicas", 0))
    return out


def observe(kube: Kube, spec: ServiceSpec, pool_sizes: Mapping[str, int]) -> Observed:
    ns = spec.namespace
    raycluster = kube.get("ray.io/v1", "RayCluster", ns, raycluster_name(spec.name))
    pools = {
        pool: count_pods(kube.list("v1", "Pod", ns, pool_selector(spec.name, pool)), size)
        for pool, size in pool_sizes.items()
    }
    deployment = kube.get("apps/v1", "Deployment", ns, router_name(spec.name))
    dstatus = (deployment or {}).get("status") or {}
    router = Counts(
        desired=spec.router.replicas,
        current=int(dstatus.get("replicas", 0)),
        ready=int(dstatus.get("readyReplicas", 0)),
    )
    service = kube.get("v1", "Service", ns, router_name(spec.name))
    return Observed(
        raycluster_exists=raycluster is not None,
        pools=pools,
        router_exists=deployment is not None,
        router=router,
        load_balancer_host=load_balancer_host(service),
    )


def _apply_children(kube: Kube, spec: ServiceSpec) -> dict[str, int]:
    """Apply every child; returns each pool's size as applied."""
    observed = observed_pool_replicas(kube, spec)
    objects = desired_objects(spec, observed)
    for obj in objects:
        if obj["kind"] == POOL_KIND and observed[obj["spec"]["pool"]] is None:
            # Created (not applied) with its first size, so spec.replicas is not ours to keep.
            kube.create(obj)
        kube.apply(apply_body(obj))
    for api_version, kind, name in stale_kinds(spec):
        try:
            kube.delete(api_version, kind, spec.namespace, name)
        except RetryableError as exc:  # ServiceMonitor CRD absent: nothing to delete
            log.debug("skipping delete of %s/%s: %s", kind, name, exc)
    return {
        pool: spec.pool(pool).replicas if size is None else size for pool, size in observed.items()
    }


def reconcile(kube: Kube, body: Mapping[str, Any], default_image: str, now: str) -> Observed:
    """Bring one service's children to their desired state and write its status.

    Raises:
        PermanentError: the spec is invalid or the API server rejected a child.
        RetryableError: a transient failure; the status says so and a retry will follow.
    """
    meta = body.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    previous = body.get("status") or {}
    try:
        spec = parse_service(body, default_image)
    except SpecError as exc:
        _write_error_status(kube, body, "InvalidSpec", str(exc), now)
        raise PermanentError(str(exc)) from exc
    try:
        sizes = _apply_children(kube, spec)
    except (RetryableError, PermanentError) as exc:
        reason = "ApplyRetrying" if isinstance(exc, RetryableError) else "ApplyFailed"
        _write_error_status(kube, body, reason, str(exc), now)
        raise
    observed = observe(kube, spec, sizes)
    status = service_status(spec, observed, previous, now)
    kube.patch_status(API_VERSION, SERVICE_KIND, namespace, name, status)
    for pool in POOLS:
        kube.patch_status(
            API_VERSION,
            POOL_KIND,
            namespace,
            pool_name(name, pool),
            pool_status(spec, pool, observed.pools[pool]),
        )
    return observed


def _write_error_status(
    kube: Kube, body: Mapping[str, Any], reason: str, message: str, now: str
) -> None:
    """Record a failed reconcile in the Ready condition, keeping the other conditions."""
    meta = body.get("metadata") or {}
    previous = body.get("status") or {}
    generation = int(meta.get("generation", 0))
    ready = {"type": "Ready", "status": "False", "reason": reason, "message": message[:1000]}
    others = [c for c in previous.get("conditions") or () if c.get("type") != "Ready"]
    conditions = merge_conditions(previous.get("conditions") or (), [ready], generation, now)
    status = {"conditions": conditions + others, "observedGeneration": generation}
    try:
        kube.patch_status(
            API_VERSION, SERVICE_KIND, str(meta.get("namespace")), str(meta.get("name")), status
        )
    except (RetryableError, PermanentError) as exc:  # the original error matters more
        log.warning("could not record %s in status: %s", reason, exc)
