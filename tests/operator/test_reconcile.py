"""The thin I/O layer against a fake API server: what one reconcile and one planner tick
send, and how failures are reported."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay_operator.autoscale import parse_rfc3339, plan_service
from kvrelay_operator.errors import PermanentError, RetryableError
from kvrelay_operator.kube import Kube
from kvrelay_operator.metrics import OperatorMetrics
from kvrelay_operator.reconcile import reconcile
from kvrelay_operator.revision import revision_hash
from tests.operator.fake_api import FakeApi
from tests.operator.services import IMAGE, cluster_of, service, service_body, worker_pod

NS = "/apis/kvrelay.io/v1alpha1/namespaces/llm"
SVC = f"{NS}/kvrelayservices/demo"
NOW = parse_rfc3339("2026-11-29T10:00:00Z") or 0.0


def ray_path(spec: dict[str, Any] | None = None) -> str:
    """The RayCluster of the revision `spec` makes."""
    revision = revision_hash(service(spec or {}))
    return f"/apis/ray.io/v1/namespaces/llm/rayclusters/demo-{revision[:8]}"


RAY = ray_path()


def _store_service(api: FakeApi, spec: dict[str, Any]) -> dict[str, Any]:
    body = service_body(spec)
    api.put(SVC, body)
    return body


def _conditions(api: FakeApi) -> dict[str, tuple[str, str]]:
    status = api.objects[SVC]["status"]
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_first_reconcile_creates_children_with_server_side_apply(
    api: tuple[FakeApi, Kube],
) -> None:
    fake, kube = api
    body = _store_service(fake, {"decode": {"replicas": 2}})
    reconcile(kube, body, IMAGE, NOW)

    # Pools are created with their first size, then applied without it.
    creates = [r for r in fake.requests if r.method == "POST" and "kvrelaypools" in r.path]
    assert [r.body["spec"] for r in creates] == [
        {"service": "demo", "pool": "prefill", "replicas": 1},
        {"service": "demo", "pool": "decode", "replicas": 2},
    ]
    applied = fake.applied()
    assert {r.path.rsplit("/", 2)[-2] for r in applied} == {
        "kvrelaypools",
        "rayclusters",
        "deployments",
        "services",
        "poddisruptionbudgets",
        "networkpolicies",
    }
    for r in applied:
        assert r.method == "PATCH"
        assert r.query == {"fieldManager": ["kvrelay-operator"], "force": ["true"]}
        if r.body["kind"] == "KVRelayPool":
            assert "replicas" not in r.body["spec"]
    groups = fake.objects[ray_path({"decode": {"replicas": 2}})]["spec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("prefill", 1), ("decode", 2)]

    # No pods yet: the status says what is missing, and each pool has its selector.
    assert _conditions(fake) == {
        "Ready": ("False", "ComponentsNotReady"),
        "PrefillReady": ("False", "WorkersNotReady"),
        "DecodeReady": ("False", "WorkersNotReady"),
        "RouterReady": ("False", "RoutersNotReady"),
    }
    pool = fake.objects[f"{NS}/kvrelaypools/demo-decode"]
    cluster = ray_path({"decode": {"replicas": 2}}).rsplit("/", 1)[1]
    assert pool["status"]["selector"] == f"ray.io/cluster={cluster},ray.io/group=decode"
    # The ServiceMonitor is not wanted: its delete was tried and found nothing.
    assert any(r.method == "DELETE" and "servicemonitors" in r.path for r in fake.requests)


def test_scaling_a_pool_resizes_its_worker_group_and_readiness_follows(
    api: tuple[FakeApi, Kube],
) -> None:
    fake, kube = api
    body = _store_service(fake, {})
    reconcile(kube, body, IMAGE, NOW)
    # An HPA scales the decode pool through the scale subresource.
    kube.scale("kvrelay.io/v1alpha1", "KVRelayPool", "llm", "demo-decode", 3)
    cluster = cluster_of()
    for i in range(3):
        pod = worker_pod(f"decode-{i}", "decode", cluster)
        fake.put(f"/api/v1/namespaces/llm/pods/decode-{i}", pod)
    fake.put("/api/v1/namespaces/llm/pods/prefill-0", worker_pod("prefill-0", "prefill", cluster))
    fake.objects["/apis/apps/v1/namespaces/llm/deployments/demo-router"]["status"] = {
        "replicas": 2,
        "readyReplicas": 2,
    }
    reconcile(kube, fake.objects[SVC], IMAGE, NOW)
    groups = fake.objects[RAY]["spec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("prefill", 1), ("decode", 3)]
    assert fake.objects[f"{NS}/kvrelaypools/demo-decode"]["spec"]["replicas"] == 3
    assert _conditions(fake)["Ready"] == ("True", "AllReady")
    assert fake.objects[SVC]["status"]["decode"] == {"replicas": 3, "readyReplicas": 3}


@pytest.mark.parametrize(
    ("status", "error", "reason"),
    [(422, PermanentError, "ApplyFailed"), (503, RetryableError, "ApplyRetrying")],
)
def test_a_failed_apply_is_reported_and_classified(
    api: tuple[FakeApi, Kube], status: int, error: type, reason: str
) -> None:
    fake, kube = api
    body = _store_service(fake, {})
    fake.failures[("PATCH", RAY)] = status
    with pytest.raises(error):
        reconcile(kube, body, IMAGE, NOW)
    assert _conditions(fake)["Ready"] == ("False", reason)


def test_an_invalid_spec_is_permanent_and_reported(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    body = service_body({})
    body["spec"]["model"] = {"source": "pvc"}  # admission would have refused this
    fake.put(SVC, body)
    with pytest.raises(PermanentError, match="claimName"):
        reconcile(kube, body, IMAGE, NOW)
    assert _conditions(fake)["Ready"] == ("False", "InvalidSpec")
    assert not fake.applied()


def _router_text(ttft: float, count: int) -> str:
    lines = ["# TYPE kvrelay_time_to_first_token_seconds histogram"]
    for le in ("0.1", "0.5", "1.0", "2.5", "+Inf"):
        n = count if le == "+Inf" or float(le) >= ttft else 0
        lines.append(f'kvrelay_time_to_first_token_seconds_bucket{{model="m",le="{le}"}} {n}')
    lines.append(f'kvrelay_time_to_first_token_seconds_count{{model="m"}} {count}')
    lines.append(f'kvrelay_time_to_first_token_seconds_sum{{model="m"}} {ttft * count}')
    return "\n".join(lines) + "\n"


def test_planner_tick_scales_the_pool_and_records_why(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "target": "500ms"}
    body = _store_service(fake, {"prefill": {"autoscaling": auto}})
    reconcile(kube, body, IMAGE, NOW)
    spec = service({"prefill": {"autoscaling": auto}})
    metrics = OperatorMetrics()
    events: list[tuple[str, str, str]] = []

    def emit(type_: str, reason: str, message: str) -> None:
        events.append((type_, reason, message))

    # First tick: no window yet, hold.
    first = plan_service(kube, spec, [_router_text(0.05, 10)], {}, None, metrics, emit, 1000.0)
    assert events == []
    assert fake.objects[SVC]["status"]["planner"]["prefill"]["reason"].startswith("NoMetrics")
    # Second tick: 20 new requests, all around 2 s: p90 over 4x the target -> 1 -> 4.
    plan_service(
        kube,
        spec,
        [_router_text(2.0, 30)],
        fake.objects[SVC]["status"],
        first,
        metrics,
        emit,
        1015.0,
    )
    pool = fake.objects[f"{NS}/kvrelaypools/demo-prefill"]
    assert pool["spec"]["replicas"] == 4
    planner = fake.objects[SVC]["status"]["planner"]["prefill"]
    assert planner["desiredReplicas"] == 4
    assert planner["reason"].startswith("AboveTarget")
    assert planner["lastScaleTime"] == "1970-01-01T00:16:55Z"
    assert events[-1][:2] == ("Normal", "ScaledPrefill")
    value = metrics.registry.get_sample_value(
        "kvrelay_planner_desired_replicas",
        {"namespace": "llm", "service": "demo", "pool": "prefill"},
    )
    assert value == 4
    # The scale went through the scale subresource, as an HPA's would.
    assert any(r.path.endswith("/kvrelaypools/demo-prefill/scale") for r in fake.requests)
