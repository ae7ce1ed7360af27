"""The chart's Grafana dashboards as data: their panels, PromQL and metric names."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache

from tests.deploy.schemas import CHART

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# kvrelay's own names, and vLLM's that the router also exports (gateway_metrics.py).
_METRIC = re.compile(r"\b(?:kvrelay_|vllm:)[a-z0-9_]+")
_SUFFIX = re.compile(r"_(bucket|sum|count|total)$")


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    expr: str


@cache
def queries() -> list[Query]:
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                out.append(Query(dashboard["uid"], panel["title"], target["expr"]))
    return out


def metric_base_names(expr: str) -> set[str]:
    """Metric names an expression reads, without exposition suffixes."""
    return {_SUFFIX.sub("", name) for name in _METRIC.findall(expr)}


def exported_metric_names() -> set[str]:
    """Every base name the router and the operator export, from their registries."""
    from kvrelay.metrics import metric_names as router_names
    from kvrelay_operator.metrics import metric_names as operator_names

    return router_names() | operator_names()


def substitute(expr: str, namespace: str, service: str, rate_interval: str) -> str:
    """The expression as Grafana would send it with these variable values."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$namespace", namespace)
        .replace("$kvrelay", service)
    )
