"""The operator's own Prometheus metrics, in their own registry (served on `--metrics-port`).

The dashboards plot `kvrelay_planner_*` beside the pools' real sizes; the router's metrics
live in `kvrelay.metrics` and are not imported here (the operator talks to the platform
only through Kubernetes and HTTP).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class OperatorMetrics:
    """Planner gauges are labelled by the KVRelayService (namespace, service) and pool; the
    chart's ServiceMonitor keeps these labels (honorLabels) over the scrape target's own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.desired_replicas = Gauge(
            "kvrelay_planner_desired_replicas",
            "Replicas the planner wants for a pool.",
            ["namespace", "service", "pool"],
            registry=r,
        )
        self.current_replicas = Gauge(
            "kvrelay_planner_current_replicas",
            "Replicas a pool has (its KVRelayPool's spec.replicas).",
            ["namespace", "service", "pool"],
            registry=r,
        )
        self.signal = Gauge(
            "kvrelay_planner_signal",
            "The SLO signal the planner last saw (seconds, or a ratio for kvUsage).",
            ["namespace", "service", "pool", "metric"],
            registry=r,
        )
        self.target = Gauge(
            "kvrelay_planner_target",
            "The pool's SLO target (seconds, or a ratio for kvUsage).",
            ["namespace", "service", "pool", "metric"],
            registry=r,
        )
        self.decisions = Counter(
            "kvrelay_planner_decisions",
            "Planner decisions by action and reason.",
            ["namespace", "service", "pool", "action", "reason"],
            registry=r,
        )
        self.reconciles = Counter(
            "kvrelay_operator_reconciles",
            "Reconciles of a KVRelayService by result (ok, retryable, permanent).",
            ["result"],
            registry=r,
        )


def metric_names() -> set[str]:
    """Base names (no `_total`) of every metric the operator exports."""
    return {family.name for family in OperatorMetrics().registry.collect()}
