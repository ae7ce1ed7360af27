"""Each pool's step on one RayCluster: read its group and pods, ask the routers to drain
the workers a shrink removes (drain.py decides which and when). Shared by the plain
reconcile and a Rolling upgrade's shrinking old revision; only API calls around pure
decisions.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.api_key import api_key_ref
from kvrelay_operator.autoscale import parse_rfc3339
from kvrelay_operator.drain import PodInfo, ScaleDown, Step, WorkerInfo, next_step
from kvrelay_operator.errors import PermanentError
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import (
    API_VERSION,
    POOL_KIND,
    POOLS,
    pool_name,
    pool_selector,
    raycluster_name,
)
from kvrelay_operator.router_admin import RouterAdmin, admin_url
from kvrelay_operator.spec import ServiceSpec

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


def pod_info(pod: Mapping[str, Any]) -> PodInfo:
    meta = pod.get("metadata") or {}
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return PodInfo(
        name=str(meta.get("name", "")),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        terminating=bool(meta.get("deletionTimestamp")),
        created=str(meta.get("creationTimestamp", "")),
    )


def group_sizes(cluster: Mapping[str, Any] | None) -> dict[str, int]:
    groups = ((cluster or {}).get("spec") or {}).get("workerGroupSpecs") or ()
    return {str(g["groupName"]): int(g.get("replicas", 0)) for g in groups}


def _router_api_key(kube: Kube, spec: ServiceSpec) -> str:
    name, key = api_key_ref(spec)  # the service's Secret, or the one the operator made
    try:
        secret = kube.get("v1", "Secret", spec.namespace, name)
    except PermanentError as exc:
        if exc.status != 403:
            raise
        # rbac.secrets off: the drain is refused (401) and the shrink waits for its timeout.
        log.warning("%s: cannot read the router's API key to drain workers: %s", spec.name, exc)
        return ""
    value = ((secret or {}).get("data") or {}).get(key, "")
    return base64.b64decode(value).decode() if value else ""


def plan_pools(
    ctx: Context, spec: ServiceSpec, revision: str, wanted: Mapping[str, int], previous: Any
) -> dict[str, Step]:
    """Each pool's step (drain.next_step), draining through the router where one starts."""
    kube, ns = ctx.kube, spec.namespace
    cluster = kube.get(*RAY, ns, raycluster_name(spec.name, revision))
    groups = group_sizes(cluster)
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
            pod_info(p)
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
