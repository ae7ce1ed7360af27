"""Observed children -> status and conditions, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay_operator.status import (
    Counts,
    Observed,
    count_pods,
    load_balancer_host,
    pool_status,
    service_status,
)
from tests.deploy.schemas import validate_custom
from tests.operator.services import service, service_body

T0 = "2026-11-29T10:00:00Z"
T1 = "2026-11-29T10:05:00Z"

ALL_UP = Observed(
    raycluster_exists=True,
    pools={"prefill": Counts(1, 1, 1), "decode": Counts(2, 2, 2)},
    router_exists=True,
    router=Counts(2, 2, 2),
)


def _conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


CASES: list[tuple[str, Observed, dict[str, tuple[str, str]]]] = [
    (
        "nothing yet",
        Observed(),
        {
            "Ready": ("False", "ComponentsNotReady"),
            "PrefillReady": ("False", "RayClusterMissing"),
            "DecodeReady": ("False", "RayClusterMissing"),
            "RouterReady": ("False", "DeploymentMissing"),
        },
    ),
    (
        "all up",
        ALL_UP,
        {
            "Ready": ("True", "AllReady"),
            "PrefillReady": ("True", "WorkersReady"),
            "DecodeReady": ("True", "WorkersReady"),
            "RouterReady": ("True", "RoutersReady"),
        },
    ),
    (
        "decode short of workers",
        Observed(
            raycluster_exists=True,
            pools={"prefill": Counts(1, 1, 1), "decode": Counts(2, 2, 1)},
            router_exists=True,
            router=Counts(2, 2, 2),
        ),
        {
            "Ready": ("False", "ComponentsNotReady"),
            "PrefillReady": ("True", "WorkersReady"),
            "DecodeReady": ("False", "WorkersNotReady"),
            "RouterReady": ("True", "RoutersReady"),
        },
    ),
    (
        "prefill scaled to zero still serves",
        Observed(
            raycluster_exists=True,
            pools={"prefill": Counts(0, 0, 0), "decode": Counts(1, 1, 1)},
            router_exists=True,
            router=Counts(1, 1, 1),
        ),
        {
            "Ready": ("True", "AllReady"),
            "PrefillReady": ("True", "ScaledToZero"),
            "DecodeReady": ("True", "WorkersReady"),
            "RouterReady": ("True", "RoutersReady"),
        },
    ),
    (
        "decode scaled to zero cannot serve",
        Observed(
            raycluster_exists=True,
            pools={"prefill": Counts(1, 1, 1), "decode": Counts(0, 0, 0)},
            router_exists=True,
            router=Counts(1, 1, 1),
        ),
        {
            "Ready": ("False", "ComponentsNotReady"),
            "PrefillReady": ("True", "WorkersReady"),
            "DecodeReady": ("False", "ScaledToZero"),
            "RouterReady": ("True", "RoutersReady"),
        },
    ),
    (
        "router rolling",
        Observed(
            raycluster_exists=True,
            pools={"prefill": Counts(1, 1, 1), "decode": Counts(1, 1, 1)},
            router_exists=True,
            router=Counts(2, 3, 1),
        ),
        {
            "Ready": ("False", "ComponentsNotReady"),
            "PrefillReady": ("True", "WorkersReady"),
            "DecodeReady": ("True", "WorkersReady"),
            "RouterReady": ("False", "RoutersNotReady"),
        },
    ),
    (
        "reconcile failed",
        Observed(
            raycluster_exists=True,
            pools=ALL_UP.pools,
            router_exists=True,
            router=ALL_UP.router,
            error=("ApplyRetrying", "RayCluster CRD missing"),
        ),
        {
            "Ready": ("False", "ApplyRetrying"),
            "PrefillReady": ("True", "WorkersReady"),
            "DecodeReady": ("True", "WorkersReady"),
            "RouterReady": ("True", "RoutersReady"),
        },
    ),
]


@pytest.mark.parametrize(
    ("observed", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_conditions(observed: Observed, expected: dict[str, tuple[str, str]]) -> None:
    status = service_status(service({}, generation=3), observed, {}, T0)
    assert _conds(status) == expected
    for cond in status["conditions"]:
        assert cond["observedGeneration"] == 3
        assert cond["lastTransitionTime"] == T0
        assert cond["message"]
    # What is written validates against the CRD's status schema.
    validate_custom(service_body({}, status=status))


def test_ready_message_names_what_is_missing() -> None:
    observed = CASES[2][1]
    status = service_status(service({}), observed, {}, T0)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "waiting for DecodeReady (1/2 decode workers ready)"


def test_transition_time_moves_only_when_the_status_changes() -> None:
    spec = service({})
    first = service_status(spec, CASES[2][1], {}, T0)  # decode not ready
    second = service_status(spec, ALL_UP, first, T1)  # now everything is
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times == {"Ready": T1, "PrefillReady": T0, "DecodeReady": T1, "RouterReady": T0}
    third = service_status(spec, ALL_UP, second, "2026-11-29T11:00:00Z")
    assert third["conditions"] == second["conditions"]


def test_replica_counts_and_endpoint() -> None:
    status = service_status(service({}), ALL_UP, {}, T0)
    assert status["prefill"] == {"replicas": 1, "readyReplicas": 1}
    assert status["decode"] == {"replicas": 2, "readyReplicas": 2}
    assert status["router"] == {"replicas": 2, "readyReplicas": 2}
    assert status["endpoint"] == "http://demo-router.llm.svc:8000/v1"
    lb = Observed(**{**ALL_UP.__dict__, "load_balancer_host": "10.1.2.3"})
    assert service_status(service({}), lb, {}, T0)["endpoint"] == "http://10.1.2.3:8000/v1"


def _pod(phase: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = T0
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions}}


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([], Counts(2, 0, 0)),
        ([_pod("Running", True), _pod("Pending", False)], Counts(2, 2, 1)),
        ([_pod("Running", True), _pod("Running", True, deleting=True)], Counts(2, 1, 1)),
        ([_pod("Failed", False), _pod("Running", False)], Counts(2, 1, 0)),
    ],
)
def test_count_pods(pods: list[dict[str, Any]], expected: Counts) -> None:
    assert count_pods(pods, 2) == expected


def test_pool_status_gives_the_scale_subresource_a_selector() -> None:
    status = pool_status(service({}), "decode", "0123456789ab", Counts(3, 2, 1))
    assert status == {
        "replicas": 2,
        "readyReplicas": 1,
        # The serving revision's pods: the new cluster's once a revision rolls out.
        "selector": "ray.io/cluster=demo-01234567,ray.io/group=decode",
    }


@pytest.mark.parametrize(
    ("svc", "host"),
    [
        (None, ""),
        ({"status": {}}, ""),
        ({"status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}}, "1.2.3.4"),
        ({"status": {"loadBalancer": {"ingress": [{"hostname": "lb.example"}]}}}, "lb.example"),
    ],
)
def test_load_balancer_host(svc: dict[str, Any] | None, host: str) -> None:
    assert load_balancer_host(svc) == host
