"""One planner tick for a service: scrape its routers, decide each autoscaled pool's size,
scale the KVRelayPool, and record why (status, events, gauges).

The rule itself is `planner.decide`; the signal is `signals.pool_signal`. The previous
scrape is kept by the caller between ticks (a latency percentile needs a window); the last
scale time is kept in the service's status so a restarted operator still honours cooldowns.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from kvrelay_operator.kube import Kube
from kvrelay_operator.metrics import OperatorMetrics
from kvrelay_operator.names import (
    API_VERSION,
    HTTP_PORT,
    POOL_KIND,
    POOLS,
    SERVICE_KIND,
    component_selector,
    pool_name,
)
from kvrelay_operator.planner import Decision, decide
from kvrelay_operator.signals import RouterSample, parse_router_metrics, pool_signal
from kvrelay_operator.spec import ServiceSpec

log = logging.getLogger(__name__)

Emit = Callable[[str, str, str], None]  # (event type, reason, message)


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def autoscaled_pools(spec: ServiceSpec) -> list[str]:
    return [p for p in POOLS if spec.pool(p).autoscaling.enabled]


def scrape_routers(kube: Kube, spec: ServiceSpec, timeout: float = 2.0) -> list[str]:
    """`/metrics` of every running router pod; a pod that does not answer is skipped."""
    selector = component_selector(spec.name, "router")
    texts = []
    for pod in kube.list("v1", "Pod", spec.namespace, selector):
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or (pod.get("status") or {}).get("phase") != "Running":
            continue
        try:
            with urllib.request.urlopen(f"http://{ip}:{HTTP_PORT}/metrics", timeout=timeout) as r:
                texts.append(r.read().decode())
        except OSError as exc:
            log.info("router %s did not answer /metrics: %s", ip, exc)
    return texts


def planner_status(
    decision: Decision, signal: float | None, target: float, last_scale: float | None
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "desiredReplicas": decision.replicas,
        "target": target,
        "reason": f"{decision.reason}: {decision.message}",
    }
    if signal is not None:
        status["signal"] = round(signal, 6)
    if last_scale is not None:
        status["lastScaleTime"] = rfc3339(last_scale)
    return status


def plan_service(
    kube: Kube,
    spec: ServiceSpec,
    texts: list[str],
    previous_status: Mapping[str, Any],
    previous_sample: RouterSample | None,
    metrics: OperatorMetrics,
    emit: Emit,
    now: float,
) -> RouterSample | None:
    """Run one tick over `texts`, the routers' `/metrics` (`scrape_routers`); returns this
    tick's sample, to pass back as `previous_sample` next time."""
    pools = autoscaled_pools(spec)
    if not pools:
        return None
    sample = parse_router_metrics(texts) if texts else None
    planner_prev = previous_status.get("planner") or {}
    # null removes a pool the planner no longer sizes (a merge patch).
    new_status: dict[str, Any] = {p: None for p in POOLS if p not in pools}
    for pool in pools:
        auto = spec.pool(pool).autoscaling
        name = pool_name(spec.name, pool)
        obj = kube.get(API_VERSION, POOL_KIND, spec.namespace, name)
        if obj is None:
            continue  # the reconcile creates it; plan on the next tick
        current = int((obj.get("spec") or {}).get("replicas", 0))
        signal = None if sample is None else pool_signal(pool, auto, previous_sample, sample)
        last = parse_rfc3339((planner_prev.get(pool) or {}).get("lastScaleTime"))
        decision = decide(auto, current, signal, last, now)
        if decision.changes:
            kube.scale(API_VERSION, POOL_KIND, spec.namespace, name, decision.replicas)
            last = now
            emit("Normal", f"Scaled{pool.capitalize()}", decision.message)
        labels = (spec.namespace, spec.name, pool)
        metrics.desired_replicas.labels(*labels).set(decision.replicas)
        metrics.current_replicas.labels(*labels).set(current)
        metrics.target.labels(*labels, auto.metric).set(auto.target)
        if signal is not None:
            metrics.signal.labels(*labels, auto.metric).set(signal)
        metrics.decisions.labels(*labels, decision.action, decision.reason).inc()
        new_status[pool] = planner_status(decision, signal, auto.target, last)
    kube.patch_status(API_VERSION, SERVICE_KIND, spec.namespace, spec.name, {"planner": new_status})
    return sample
