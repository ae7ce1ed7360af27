"""One level-based reconcile of a KVRelayService: apply every desired child, shrink pools
by draining first, retire old revisions, read the children back, write the status. The
same steps run on create, update, resume and every resync tick, so a missed event costs
nothing but a delay.

The decisions are in the pure modules (`desired`, `drain`, `revision`, `status`); this
file only sequences the API calls around them.
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.autoscale import parse_rfc3339, rfc3339
from kvrelay_operator.desired import apply_body, desired_kv_secret, desired_objects, stale_kinds
from kvrelay_operator.drain import PodInfo, ScaleDown, Step, WorkerInfo, next_step
from kvrelay_operator.errors import PermanentError, RetryableError, SpecError
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import (
    API_VERSION,
    POOL_KIND,
    POOLS,
    SERVICE_KIND,
    component_selector,
    kv_secret_name,
    pool_name,
    pool_selector,
    raycluster_name,
    router_name,
)
from kvrelay_operator.ray_access import ensure_ray_auth_secret
from kvrelay_operator.revision import clusters_to_retire, revision_hash
from kvrelay_operator.router_admin import RouterAdmin, admin_url
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

RAY = ("ray.io/v1", "RayCluster")


@dataclass
class Context:
    """What a reconcile needs besides the service: the API, the default image, the clock,
    and how to reach a service's routers (tests point it at a local server)."""

    kube: Kube
    default_image: str
    now: float
    router_url: Callable[[ServiceSpec], str] = field(default=admin_url)


def observed_pool_replicas(kube: Kube, spec: ServiceSpec) -> dict[str, int | None]:
    """Each pool's KVRelayPool `spec.replicas`, None where the pool does not exist yet."""
    out: dict[str, int | None] = {}
    for pool in POOLS:
        obj = kube.get(API_VERSION, POOL_KIND, spec.namespace, pool_name(spec.name, pool))
        out[pool] = None if obj is None else int((obj.get("spec") or {}).get("replicas", 0))
    return out


def observe(kube: Kube, spec: ServiceSpec, revision: str, sizes: Mapping[str, int]) -> Observed:
    ns = spec.namespace
    raycluster = kube.get(*RAY, ns, raycluster_name(spec.name, revision))
    pools = {
        pool: count_pods(kube.list("v1", "Pod", ns, pool_selector(spec.name, pool, revision)), n)
        for pool, n in sizes.items()
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


def _pod_info(pod: Mapping[str, Any]) -> PodInfo:
    meta = pod.get("metadata") or {}
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return PodInfo(
        name=str(meta.get("name", "")),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        terminating=bool(meta.get("deletionTimestamp")),
        created=str(meta.get("creationTimestamp", "")),
    )


def _group_sizes(cluster: Mapping[str, Any] | None) -> dict[str, int]:
    groups = ((cluster or {}).get("spec") or {}).get("workerGroupSpecs") or ()
    return {str(g["groupName"]): int(g.get("replicas", 0)) for g in groups}


def _router_api_key(kube: Kube, spec: ServiceSpec) -> str:
    if not spec.router.api_key_secret:
        return ""
    try:
        secret = kube.get("v1", "Secret", spec.namespace, spec.router.api_key_secret)
    except PermanentError as exc:
        if exc.status != 403:
            raise
        # rbac.secrets off: the drain is refused (401) and the shrink waits for its timeout.
        log.warning("%s: cannot read the router's API key to drain workers: %s", spec.name, exc)
        return ""
    value = ((secret or {}).get("data") or {}).get(spec.router.api_key_key, "")
    return base64.b64decode(value).decode() if value else ""


def plan_pools(
    ctx: Context, spec: ServiceSpec, revision: str, wanted: Mapping[str, int], previous: Any
) -> dict[str, Step]:
    """Each pool's step (drain.next_step), draining through the router where one starts."""
    kube, ns = ctx.kube, spec.namespace
    cluster = kube.get(*RAY, ns, raycluster_name(spec.name, revision))
    groups = _group_sizes(cluster)
    scale_down = (previous or {}).get("scaleDown") or {}
    if (previous or {}).get("generation") != revision:
        scale_down = {}  # a shrink of the old revision's cluster: that cluster is retiring
    admin: RouterAdmin | None = None
    workers: list[WorkerInfo] | None = None
    steps = {}
    for pool in POOLS:
        raw = scale_down.get(pool)
        record = ScaleDown.from_status(raw, parse_rfc3339((raw or {}).get("startedAt")))
        group = groups.get(pool) if cluster is not None else None
        if record is None and (group is None or wanted[pool] >= group):
            steps[pool] = Step(group_replicas=wanted[pool])
            continue
        pods = [
            _pod_info(p)
            for p in kube.list("v1", "Pod", ns, pool_selector(spec.name, pool, revision))
        ]
        if admin is None:
            admin = RouterAdmin(ctx.router_url(spec), _router_api_key(kube, spec))
            workers = admin.workers()
        timeout = spec.pool(pool).drain_timeout_s
        steps[pool] = step = next_step(wanted[pool], group, record, pods, workers, ctx.now, timeout)
        if step.drain:
            admin.drain(step.drain)
    return steps


def _ensure_kv_secret(kube: Kube, spec: ServiceSpec) -> None:
    """Create the KV transfer Secret once when the service names none of its own."""
    if spec.kv.secret_name:
        return
    try:
        if kube.get("v1", "Secret", spec.namespace, kv_secret_name(spec.name)) is None:
            kube.create(desired_kv_secret(spec, secrets.token_bytes(32)))
    except PermanentError as exc:
        if exc.status != 403:
            raise
        raise PermanentError(
            f"cannot create the KV secret {kv_secret_name(spec.name)}: name a Secret in "
            "spec.kvTransfer.secretName, or let the operator manage Secrets "
            f"(chart value rbac.secrets): {exc}",
            status=403,
        ) from exc


def _delete_stale(kube: Kube, spec: ServiceSpec) -> None:
    for api_version, kind, name in stale_kinds(spec):
        try:
            kube.delete(api_version, kind, spec.namespace, name)
        except RetryableError as exc:  # ServiceMonitor CRD absent: nothing to delete
            log.debug("skipping delete of %s/%s: %s", kind, name, exc)
        except PermanentError as exc:
            if exc.status != 403:
                raise
            # No ServiceMonitor rights (rbac.serviceMonitors off): none can have been made.
            log.debug("no rights to delete %s/%s: %s", kind, name, exc)


def retire_revisions(kube: Kube, spec: ServiceSpec, revision: str) -> list[str]:
    """Delete the RayClusters of older revisions that no router pod uses any more."""
    ns = spec.namespace
    clusters = kube.list(*RAY, ns, component_selector(spec.name, "ray"))
    routers = kube.list("v1", "Pod", ns, component_selector(spec.name, "router"))
    retired = clusters_to_retire(clusters, routers, revision)
    for name in retired:
        log.info("%s/%s: retiring RayCluster %s (no router uses it)", ns, spec.name, name)
        kube.delete(*RAY, ns, name)
    return retired


def _apply_children(
    ctx: Context, spec: ServiceSpec, revision: str, previous: Any
) -> tuple[dict[str, int], dict[str, Step]]:
    """Apply every child; returns each pool's wanted size and its step."""
    kube = ctx.kube
    _ensure_kv_secret(kube, spec)
    ensure_ray_auth_secret(kube, spec)
    observed = observed_pool_replicas(kube, spec)
    wanted = {
        pool: spec.pool(pool).replicas if size is None else size for pool, size in observed.items()
    }
    steps = plan_pools(ctx, spec, revision, wanted, previous)
    objects = desired_objects(
        spec,
        observed,
        {pool: step.group_replicas for pool, step in steps.items()},
        {pool: step.workers_to_delete for pool, step in steps.items()},
    )
    for obj in objects:
        if obj["kind"] == POOL_KIND and observed[obj["spec"]["pool"]] is None:
            # Created (not applied) with its first size, so spec.replicas is not ours to keep.
            kube.create(obj)
        kube.apply(apply_body(obj))
    _delete_stale(kube, spec)
    retire_revisions(kube, spec, revision)
    return wanted, steps


def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    default_image: str,
    now: float,
    router_url: Callable[[ServiceSpec], str] = admin_url,
) -> Observed:
    """Bring one service's children to their desired state and write its status.

    Raises:
        PermanentError: the spec is invalid or the API server rejected a child.
        RetryableError: a transient failure; the status says so and a retry will follow.
    """
    ctx = Context(kube, default_image, now, router_url)
    meta = body.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    previous = body.get("status") or {}
    stamp = rfc3339(now)
    try:
        spec = parse_service(body, default_image)
    except SpecError as exc:
        _write_error_status(kube, body, "InvalidSpec", str(exc), stamp)
        raise PermanentError(str(exc)) from exc
    revision = revision_hash(spec)
    try:
        sizes, steps = _apply_children(ctx, spec, revision, previous)
    except (RetryableError, PermanentError) as exc:
        reason = "ApplyRetrying" if isinstance(exc, RetryableError) else "ApplyFailed"
        _write_error_status(kube, body, reason, str(exc), stamp)
        raise
    observed = observe(kube, spec, revision, sizes)
    status = service_status(spec, observed, previous, stamp)
    status["generation"] = revision  # the CRD status field keeps its name
    status["scaleDown"] = {
        pool: None
        if step.record is None
        else step.record.to_status(rfc3339(step.record.started_at))
        for pool, step in steps.items()
    }
    kube.patch_status(API_VERSION, SERVICE_KIND, namespace, name, status)
    for pool in POOLS:
        kube.patch_status(
            API_VERSION,
            POOL_KIND,
            namespace,
            pool_name(name, pool),
            pool_status(spec, pool, revision, observed.pools[pool]),
        )
    return observed


def draining(observed_status: Mapping[str, Any]) -> bool:
    """Whether a shrink is in progress (the kopf layer then checks again soon)."""
    return any((observed_status.get("scaleDown") or {}).values())


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
