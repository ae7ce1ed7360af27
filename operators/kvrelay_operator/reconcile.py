"""One level-based reconcile of a KVRelayService: apply every desired child, shrink pools
by draining first, retire old revisions, read the children back, write the status. The
same steps run on create, update, resume and every resync tick, so a missed event costs
nothing but a delay.

While a Rolling upgrade replaces the routers' revision, its reconcile is `_apply_rolling`
(rollout.py, rolling.py); otherwise the same path serves create, resize and BlueGreen.

The decisions are in the pure modules (`desired`, `drain`, `revision`, `rolling`, `status`);
this file only sequences the API calls around them.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay_operator.api_key import ensure_api_key_secret
from kvrelay_operator.autoscale import rfc3339
from kvrelay_operator.default_gate import Choice, choose
from kvrelay_operator.desired import apply_body, desired_kv_secret, desired_objects, stale_kinds
from kvrelay_operator.drain import Step
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
from kvrelay_operator.podparts import Obj
from kvrelay_operator.pool_steps import RAY, Context, observed_pool_replicas, plan_pools
from kvrelay_operator.ray_access import ensure_ray_auth_secret
from kvrelay_operator.revision import clusters_to_retire, revision_hash
from kvrelay_operator.rollout import (
    after_switch,
    emit,
    plan_rollout,
    resized_cluster,
    rollout_status,
    serving_revision,
)
from kvrelay_operator.router_admin import admin_url
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


def retire_revisions(
    kube: Kube, spec: ServiceSpec, revision: str, keep: tuple[str, ...] = ()
) -> list[str]:
    """Delete the RayClusters of older revisions that no router pod uses any more (nor
    `keep` names)."""
    ns = spec.namespace
    clusters = kube.list(*RAY, ns, component_selector(spec.name, "ray"))
    routers = kube.list("v1", "Pod", ns, component_selector(spec.name, "router"))
    retired = clusters_to_retire(clusters, routers, revision, keep)
    for name in retired:
        log.info("%s/%s: retiring RayCluster %s (no router uses it)", ns, spec.name, name)
        kube.delete(*RAY, ns, name)
    return retired


@dataclass
class Applied:
    """What one reconcile applied: each pool's size, each serving pool's step, the revision
    the routers serve, and a Rolling upgrade's status and condition (None without one)."""

    wanted: dict[str, int]
    steps: dict[str, Step]
    serving: str
    rollout: Obj | None = None
    progressing: Obj | None = None


def _apply_all(kube: Kube, objects: list[Obj], observed: Mapping[str, int | None]) -> None:
    for obj in objects:
        if obj["kind"] == POOL_KIND and observed[obj["spec"]["pool"]] is None:
            # Created (not applied) with its first size, so spec.replicas is not ours to keep.
            kube.create(obj)
        kube.apply(apply_body(obj))


def _apply_children(ctx: Context, spec: ServiceSpec, target: str, previous: Any) -> Applied:
    """Apply every child: the serving revision's (today's path), or a Rolling upgrade's."""
    kube = ctx.kube
    _ensure_kv_secret(kube, spec)
    ensure_ray_auth_secret(kube, spec)
    ensure_api_key_secret(kube, spec)  # every router has a key: none given, ours
    observed = observed_pool_replicas(kube, spec)
    wanted = {
        pool: spec.pool(pool).replicas if size is None else size for pool, size in observed.items()
    }
    serving = serving_revision(kube, spec, previous, target)
    if serving != target:
        return _apply_rolling(ctx, spec, (serving, target), previous, observed, wanted)
    settling = after_switch(kube, spec, previous, target, wanted, ctx.now)
    steps = plan_pools(ctx, spec, target, settling.sizes, previous)
    objects = desired_objects(
        spec,
        observed,
        {pool: step.group_replicas for pool, step in steps.items()},
        {pool: step.workers_to_delete for pool, step in steps.items()},
    )
    _apply_all(kube, objects, observed)
    _delete_stale(kube, spec)
    retire_revisions(kube, spec, target)
    emit(kube, spec, settling.events, ctx.now, target)
    return Applied(wanted, steps, target, settling.record, settling.condition)


def _apply_rolling(
    ctx: Context,
    spec: ServiceSpec,
    revisions: tuple[str, str],
    previous: Any,
    observed: Mapping[str, int | None],
    wanted: dict[str, int],
) -> Applied:
    """A Rolling upgrade's reconcile: the new RayCluster at the roll's sizes, the old one
    shrunk by draining (re-applied as the API holds it), the router Deployment left on the
    old revision until the switch (rollout.py)."""
    kube, (serving, target) = ctx.kube, revisions
    outcome = plan_rollout(kube, spec, previous, revisions, wanted, ctx.now)
    steps = plan_pools(ctx, spec, serving, outcome.old_wanted, previous)
    switch = outcome.serving == target
    objects = [
        obj
        for obj in desired_objects(spec, observed, outcome.new_groups or {})
        if not (obj["kind"] == "Deployment" and not switch)
        and not (obj["kind"] == "RayCluster" and outcome.new_groups is None)
    ]
    _apply_all(kube, objects, observed)
    live = kube.get(*RAY, spec.namespace, raycluster_name(spec.name, serving))
    if live is not None:
        kube.apply(resized_cluster(live, steps))
    _delete_stale(kube, spec)
    if outcome.new_groups is None:  # rolled back: the new RayCluster goes
        retire_revisions(kube, spec, serving)
    else:
        retire_revisions(kube, spec, target, keep=(serving,))
    emit(kube, spec, outcome.events, ctx.now, target)
    if switch:  # the old revision's shrinks end with its RayCluster
        steps = {pool: Step(group_replicas=step.group_replicas) for pool, step in steps.items()}
    return Applied(wanted, steps, outcome.serving, outcome.record, outcome.condition)


def _record_choice(applied: Applied, choice: Choice) -> None:
    """A service held in the queue for a new default image reports so (default_gate.py); a
    roll records what started it."""
    if choice.rollout is not None:
        applied.rollout, applied.progressing = choice.rollout, choice.condition
    elif applied.rollout is not None:
        applied.rollout["trigger"] = choice.trigger


def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    default_image: str,
    now: float,
    router_url: Callable[[ServiceSpec], str] = admin_url,
    watched: tuple[str, ...] | None = None,
) -> Observed:
    """Bring one service's children to their desired state and write its status; `watched`
    names the operator's namespaces (None: all), whose services a new default image rolls
    one at a time (default_gate.py).

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
        parse_service(body, default_image)
    except SpecError as exc:
        _write_error_status(kube, body, "InvalidSpec", str(exc), stamp)
        raise PermanentError(str(exc)) from exc
    try:
        choice = choose(kube, body, default_image, now, watched)
        spec, target = choice.spec, revision_hash(choice.spec)
        applied = _apply_children(ctx, spec, target, previous)
    except (RetryableError, PermanentError) as exc:
        reason = "ApplyRetrying" if isinstance(exc, RetryableError) else "ApplyFailed"
        _write_error_status(kube, body, reason, str(exc), stamp)
        raise
    _record_choice(applied, choice)
    serving = applied.serving
    observed = observe(kube, spec, serving, applied.wanted)
    extra = [applied.progressing] if applied.progressing else []
    status = service_status(spec, observed, previous, stamp, extra)
    status["generation"] = serving  # the CRD status field keeps its name
    # The serving revision's image: mid-roll (or rolled back) the one recorded before.
    status["image"] = choice.image if serving == target else previous.get("image")
    if applied.rollout is not None:
        status["rollout"] = rollout_status(applied.rollout)
    status["scaleDown"] = {
        pool: None
        if step.record is None
        else step.record.to_status(rfc3339(step.record.started_at))
        for pool, step in applied.steps.items()
    }
    kube.patch_status(API_VERSION, SERVICE_KIND, namespace, name, status)
    for pool in POOLS:
        kube.patch_status(
            API_VERSION,
            POOL_KIND,
            namespace,
            pool_name(name, pool),
            pool_status(spec, pool, serving, observed.pools[pool]),
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
