"""What the operator's tests rely on an API server for, checked against the fake and, with
`$KVRELAY_TEST_KUBECONFIG`, a real one (issue 43): the operator makes a service's children
with the chart's RBAC only; the server refuses services their CRD refuses (structural
schema, CEL rules, transition rules), prunes unknown fields or refuses them under Strict;
two field managers conflict unless one forces, a field an apply stops sending goes, and the
operator never takes the replicas a scaler set. The fake-only tests at the end cover what a
real server needs no test for."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay_operator.errors import PermanentError
from kvrelay_operator.kube import resource_path
from kvrelay_operator.names import API_VERSION, FIELD_MANAGER
from kvrelay_operator.reconcile import reconcile
from tests.operator.cluster import Cluster, chart_rbac, cluster
from tests.operator.fake_api import APPLY
from tests.operator.services import IMAGE

Obj = dict[str, Any]
T0 = 1_800_000_000.0
NOWHERE = "http://127.0.0.1:9"  # no router listens: a reconcile must not need one


@pytest.fixture
def api() -> Iterator[Cluster]:
    with cluster() as c:
        yield c


def _service(api: Cluster, spec: Obj | None = None, name: str = "demo") -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": "KVRelayService",
        "metadata": {"name": name, "namespace": api.namespace},
        "spec": spec or {},
    }


def _path(api: Cluster, kind: str, name: str, api_version: str = API_VERSION) -> str:
    return resource_path(api_version, kind, api.namespace, name)


def _reconcile(api: Cluster, name: str = "demo") -> None:
    body = api.admin.get(API_VERSION, "KVRelayService", api.namespace, name)
    assert body is not None
    reconcile(api.kube, body, IMAGE, T0, router_url=lambda _: NOWHERE)


def test_a_reconcile_makes_the_children_with_the_operators_rights_only(api: Cluster) -> None:
    api.admin.create(_service(api))
    _reconcile(api)
    found = {
        (api_version, kind): api.admin.list(
            api_version, kind, api.namespace, "app.kubernetes.io/instance=demo"
        )
        for api_version, kind in (
            ("ray.io/v1", "RayCluster"),
            ("apps/v1", "Deployment"),
            ("v1", "Service"),
            ("policy/v1", "PodDisruptionBudget"),
            (API_VERSION, "KVRelayPool"),
        )
    }
    counts = {kind: len(items) for (_, kind), items in found.items()}
    assert counts == {
        "RayCluster": 1,
        "Deployment": 1,
        "Service": 1,
        "PodDisruptionBudget": 3,
        "KVRelayPool": 2,
    }
    status = api.admin.get(API_VERSION, "KVRelayService", api.namespace, "demo") or {}
    assert status.get("status", {}).get("conditions")  # the status write was allowed too


REFUSED = [
    ({"imagePullPolicy": "Sometimes"}, "Always"),  # an enum
    ({"prefill": {"replicas": -1}}, "minimum"),
    ({"prefill": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "maxReplicas"),
    ({"kvTransfer": {"ucx": {"tls": "sm,cuda_ipc"}}}, "same-host"),
    ({"kvTransfer": {"rdma": {"ipcLock": True}}}, "ipcLock"),
    ({"model": {"source": "hub", "hub": {"id": "Org/M"}, "cache": {"shared": True}}}, "default"),
]


@pytest.mark.parametrize(("spec", "message"), REFUSED)
def test_the_server_refuses_what_the_crd_refuses(api: Cluster, spec: Obj, message: str) -> None:
    with pytest.raises(PermanentError, match="422") as caught:
        api.admin.create(_service(api, spec))
    assert message in str(caught.value)


def test_a_name_kuberay_cannot_use_is_refused(api: Cluster) -> None:
    with pytest.raises(PermanentError, match="DNS-1035"):
        api.admin.create(_service(api, name="llama3.1"))


def test_unknown_fields_are_pruned_or_refused_under_strict(api: Cluster) -> None:
    body = _service(api, {"replicas": 3, "prefill": {"replica": 2}})
    collection = _path(api, "KVRelayService", "")
    status, _ = api.call("POST", collection, body, [("fieldValidation", "Strict")])
    assert status == 422
    api.admin.create(body)
    stored = api.admin.get(API_VERSION, "KVRelayService", api.namespace, "demo") or {}
    assert "replicas" not in stored["spec"] and "replica" not in stored["spec"]["prefill"]
    assert stored["spec"]["prefill"]["replicas"] == 1  # and the defaults applied


def _pool(api: Cluster, pool: str = "decode", replicas: int | None = 2) -> Obj:
    spec: Obj = {"service": "demo", "pool": pool}
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": API_VERSION,
        "kind": "KVRelayPool",
        "metadata": {"name": "demo-decode", "namespace": api.namespace},
        "spec": spec,
    }


def _apply(api: Cluster, body: Obj, manager: str, force: bool = False) -> tuple[int, Obj]:
    query = [("fieldManager", manager)] + ([("force", "true")] if force else [])
    path = _path(api, body["kind"], body["metadata"]["name"])
    return api.call("PATCH", path, body, query, APPLY)


def test_two_field_managers_conflict_unless_one_forces(api: Cluster) -> None:
    assert _apply(api, _pool(api, replicas=2), "person")[0] == 201
    assert _apply(api, _pool(api, replicas=2), "gitops")[0] == 200  # the same value: shared
    status, answer = _apply(api, _pool(api, replicas=3), "gitops")
    assert status == 409 and "person" in answer["message"] and "replicas" in answer["message"]
    status, answer = _apply(api, _pool(api, replicas=3), "gitops", force=True)
    assert status == 200 and answer["spec"]["replicas"] == 3
    owners = {e["manager"]: e["fieldsV1"] for e in answer["metadata"]["managedFields"]}
    assert "f:replicas" in owners["gitops"]["f:spec"]
    assert "f:replicas" not in owners.get("person", {}).get("f:spec", {})


def test_a_field_an_apply_stops_sending_goes_unless_another_manager_owns_it(
    api: Cluster,
) -> None:
    first = _pool(api)
    first["metadata"]["labels"] = {"a": "1", "b": "2"}
    first["metadata"]["annotations"] = {"note": "x"}
    assert _apply(api, first, "gitops")[0] == 201
    path = _path(api, "KVRelayPool", "demo-decode")
    patch = {"metadata": {"labels": {"c": "3"}}}
    query = [("fieldManager", "person")]
    assert api.call("PATCH", path, patch, query, "application/merge-patch+json")[0] == 200
    second = _pool(api)
    second["metadata"]["labels"] = {"a": "1"}
    status, answer = _apply(api, second, "gitops")
    assert status == 200
    assert answer["metadata"]["labels"] == {"a": "1", "c": "3"}
    assert "annotations" not in answer["metadata"]
    assert answer["spec"]["replicas"] == 2  # still sent


def test_a_pools_identity_cannot_change(api: Cluster) -> None:
    """The CRD's transition rules (oldSelf): a pool never moves to another pool."""
    assert _apply(api, _pool(api), "person")[0] == 201
    status, answer = _apply(api, _pool(api, pool="prefill"), "person")
    assert status == 422 and "pool" in answer["message"]


def test_the_operator_never_takes_the_replicas_a_scaler_set(api: Cluster) -> None:
    api.admin.create(_service(api))
    _reconcile(api)
    path = _path(api, "KVRelayPool", "demo-decode", API_VERSION) + "/scale"
    body = {"spec": {"replicas": 4}}
    query = [("fieldManager", "hpa")]
    status, _ = api.call("PATCH", path, body, query, "application/merge-patch+json")
    assert status == 200
    _reconcile(api)
    pool = api.admin.get(API_VERSION, "KVRelayPool", api.namespace, "demo-decode") or {}
    assert pool["spec"]["replicas"] == 4
    owners = [e for e in pool["metadata"]["managedFields"] if e["manager"] == FIELD_MANAGER]
    assert owners and all("f:replicas" not in e["fieldsV1"].get("f:spec", {}) for e in owners)


# --- the fake's own rules, which a real server needs no test for --------------------------


def _fake(api: Cluster) -> Cluster:
    if api.real:
        pytest.skip("checks the fake itself")
    return api


def test_an_apply_needs_a_field_manager_and_no_managed_fields(api: Cluster) -> None:
    _fake(api)
    path = _path(api, "KVRelayPool", "demo-decode")
    assert api.call("PATCH", path, _pool(api), [], APPLY)[0] == 400
    body = copy.deepcopy(_pool(api))
    body["metadata"]["managedFields"] = [{"manager": "x"}]
    assert api.call("PATCH", path, body, [("fieldManager", "m")], APPLY)[0] == 400


def test_a_status_write_ratchets_over_a_spec_stored_before_a_rule(api: Cluster) -> None:
    """As Kubernetes 1.30+ does: the invalid spec is not the status writer's to fix."""
    fake = _fake(api).fake
    assert fake is not None
    path = _path(api, "KVRelayService", "demo")
    fake.put(path, _service(api, {"model": {"source": "pvc"}}))  # no pvc: the CEL rule fails
    api.kube.patch_status(API_VERSION, "KVRelayService", api.namespace, "demo", {"endpoint": "x"})
    assert fake.objects[path]["status"]["endpoint"] == "x"
    status, answer = api.call(
        "PATCH", path, {"spec": {"image": "b"}}, [], "application/merge-patch+json"
    )
    assert status == 200  # another field changed: the old failure still ratchets
    status, answer = api.call(
        "PATCH",
        path,
        {"spec": {"model": {"pvc": None, "source": "image"}}},
        [],
        "application/merge-patch+json",
    )
    assert status == 422 and "source image needs image" in answer["message"]


def test_chart_rbac_is_what_the_real_path_binds() -> None:
    """The real-server path runs the operator as the chart's account, bound in the test's
    namespace: the objects it applies are the chart's, for that namespace."""
    objects = chart_rbac("ns-x")
    kinds = sorted(o["kind"] for o in objects)
    assert "ServiceAccount" in kinds and "Role" in kinds and "RoleBinding" in kinds
    for obj in objects:
        if obj["kind"] in ("Role", "RoleBinding", "ServiceAccount"):
            assert obj["metadata"]["namespace"] == "ns-x"
