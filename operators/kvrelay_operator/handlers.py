"""The kopf layer: which events run a reconcile or a planner tick. Each handler is a few
lines over `reconcile` and `autoscale`; errors become kopf's temporary or permanent kinds.

Handlers go into a registry built by `build_registry`, not kopf's global one, so importing
this module registers nothing and tests can build several.

No handler puts a finalizer on a KVRelayService: children go by garbage collection (owner
references), so deleting a service never waits for the operator, even one uninstalled first.
kopf would add one for its timers (to stop them gracefully); `kopf_compat` turns that off (the
only use of kopf's private API), since a timer of a deleted service has nothing to finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvrelay_operator.autoscale import autoscaled_pools, plan_service, scrape_routers
from kvrelay_operator.errors import PermanentError, RetryableError, SpecError
from kvrelay_operator.kopf_compat import (
    TESTED_KOPF,
    is_tested,
    kopf_version,
    timers_without_finalizers,
)
from kvrelay_operator.kube import Kube
from kvrelay_operator.metrics import OperatorMetrics
from kvrelay_operator.names import (
    API_VERSION,
    GROUP,
    POOL_PLURAL,
    SERVICE_KIND,
    SERVICE_PLURAL,
    VERSION,
)
from kvrelay_operator.reconcile import draining, reconcile
from kvrelay_operator.router_admin import admin_url
from kvrelay_operator.signals import RouterSample
from kvrelay_operator.spec import ServiceSpec, parse_service

log = logging.getLogger(__name__)


@dataclass
class OperatorState:
    """What handlers share: passed to kopf as its memo."""

    kube: Kube
    default_image: str
    metrics: OperatorMetrics
    # (namespace, name) -> the previous planner scrape, for latency windows.
    samples: dict[tuple[str, str], RouterSample | None] = field(default_factory=dict)
    # How to reach a service's routers' admin API (the Service's cluster DNS name).
    router_url: Callable[[ServiceSpec], str] = admin_url
    # Pull secrets of every service pod (the chart's imagePullSecrets), besides the service's.
    pull_secrets: tuple[str, ...] = ()
    # The namespaces watched (None: all): a new default image rolls one service of them at
    # a time (default_gate.py).
    watched: tuple[str, ...] | None = None


@contextmanager
def _kopf_errors(state: OperatorState) -> Iterator[None]:
    """Count the outcome and hand kopf the kind of error it acts on."""
    try:
        yield
    except RetryableError as exc:
        state.metrics.reconciles.labels("retryable").inc()
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from exc
    except PermanentError as exc:
        state.metrics.reconciles.labels("permanent").inc()
        raise kopf.PermanentError(str(exc)) from exc
    state.metrics.reconciles.labels("ok").inc()


# How soon a shrink waiting for its drain is looked at again (the resync may be slower).
DRAIN_POLL_SECONDS = 5.0


def with_operator_pull_secrets(body: Mapping[str, Any], secrets: tuple[str, ...]) -> Any:
    """`body` as reconcile reads it: the operator's pull secrets after the service's own
    `spec.imagePullSecrets` (a copy; kopf's body is left alone)."""
    if not secrets:
        return body
    spec = dict(body.get("spec") or {})
    own = [dict(ref) for ref in spec.get("imagePullSecrets") or ()]
    names = {ref.get("name") for ref in own}
    spec["imagePullSecrets"] = own + [{"name": s} for s in secrets if s not in names]
    return {**body, "spec": spec}


def _reconcile(body: Mapping[str, Any], state: OperatorState) -> None:
    body = with_operator_pull_secrets(body, state.pull_secrets)
    with _kopf_errors(state):
        reconcile(
            state.kube,
            body,
            state.default_image,
            time.time(),
            state.router_url,
            state.watched,
        )


def build_registry(resync_seconds: float, planner_seconds: float) -> kopf.OperatorRegistry:
    # The handlers stay defined here: kopf names them by qualified name
    # (`build_registry.<locals>.on_service`) and keeps their progress under that name.
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, SERVICE_PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, registry=registry)
    def on_service(body: kopf.Body, memo: Any, **_: Any) -> None:
        _reconcile(body, memo)

    # Level-based: children's readiness changes are picked up on this resync, whatever
    # events were missed.
    @kopf.timer(*resource, interval=resync_seconds, initial_delay=resync_seconds, registry=registry)
    def resync(body: kopf.Body, memo: Any, **_: Any) -> None:
        _reconcile(body, memo)

    @kopf.timer(*resource, interval=planner_seconds, registry=registry, id="planner")
    def planner(body: kopf.Body, memo: Any, namespace: str | None, name: str, **_: Any) -> None:
        _plan(body, memo, namespace, name)

    @kopf.on.field(GROUP, VERSION, POOL_PLURAL, field="spec.replicas", registry=registry)
    def on_pool_scaled(spec: kopf.Spec, namespace: str | None, memo: Any, **_: Any) -> None:
        """A pool was scaled (HPA, KEDA, kubectl, the planner): resize its worker group now
        rather than at the next resync."""
        state: OperatorState = memo
        service = str(spec.get("service"))
        owner = state.kube.get(API_VERSION, SERVICE_KIND, str(namespace), service)
        if owner is None:
            return
        _reconcile(owner, state)
        after = state.kube.get(API_VERSION, SERVICE_KIND, str(namespace), service) or {}
        if draining(after.get("status") or {}):
            # A shrink waits for its workers to drain: look again soon, not at the resync.
            raise kopf.TemporaryError("waiting for drained workers", delay=DRAIN_POLL_SECONDS)

    @kopf.on.delete(*resource, registry=registry, optional=True)
    def on_delete(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
        """Children go with their owner (garbage collection); only forget the planner's
        window."""
        memo.samples.pop((str(namespace), name), None)

    if not is_tested(kopf_version()):
        log.warning("kopf %s is outside the tested range %s", kopf_version(), TESTED_KOPF)
    timers_without_finalizers(registry)
    return registry


def _plan(body: kopf.Body, state: OperatorState, namespace: str | None, name: str) -> None:
    """One planner tick of one service: scrape its routers, then scale its autoscaled pools."""
    try:
        spec = parse_service(body, state.default_image)
    except SpecError:
        return  # the reconcile reports it
    key = (str(namespace), name)

    def emit(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    if not autoscaled_pools(spec):
        return
    with _kopf_errors(state):
        state.samples[key] = plan_service(
            state.kube,
            spec,
            scrape_routers(state.kube, spec),
            body.get("status") or {},
            state.samples.get(key),
            state.metrics,
            emit,
            time.time(),
        )
