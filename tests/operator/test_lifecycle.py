"""Worker lifecycle through whole reconciles against the fake API server and a router that
speaks the admin API: a shrink drains first and names its pods (defect 3), a spec change
starts a new revision's RayCluster and retires the old one only when no router uses it
(defect 4), the KV secret is made once (defect 2), a missing ServiceMonitor right does not
wedge the reconcile (defect 5)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvrelay_operator.errors import PermanentError
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import REVISION_LABEL, labels
from kvrelay_operator.reconcile import reconcile
from kvrelay_operator.revision import revision_hash
from tests.deploy.schemas import validate_everywhere
from tests.operator.fake_api import FakeApi
from tests.operator.router_stub import RouterStub
from tests.operator.services import IMAGE, cluster_of, service, service_body, worker_pod

NS = "/apis/kvrelay.io/v1alpha1/namespaces/llm"
SVC = f"{NS}/kvrelayservices/demo"
PODS = "/api/v1/namespaces/llm/pods"
RAYS = "/apis/ray.io/v1/namespaces/llm/rayclusters"
T0 = 1_800_000_000.0


def _run(fake: FakeApi, kube: Kube, now: float, router: RouterStub | None = None) -> None:
    url = router.url if router is not None else "http://127.0.0.1:9"  # nothing listens
    reconcile(kube, fake.objects[SVC], IMAGE, now, router_url=lambda _: url)


def _decode_group(fake: FakeApi, cluster: str) -> dict[str, Any]:
    groups = fake.objects[f"{RAYS}/{cluster}"]["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == "decode")


def _last_applied_decode_group(fake: FakeApi, cluster: str) -> dict[str, Any]:
    """What the last apply sent: the body the operator chose, not what the store holds after
    the server merged it with other managers' fields."""
    applied = [r for r in fake.applied() if r.path == f"{RAYS}/{cluster}"]
    groups = applied[-1].body["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == "decode")


def _start(fake: FakeApi, kube: Kube, spec: dict[str, Any], router: RouterStub) -> str:
    """A service with three decode pods up, each with one worker the router knows."""
    fake.put(SVC, service_body(spec))
    _run(fake, kube, T0, router)
    cluster = cluster_of(spec)
    for i, name in enumerate(("d-0", "d-1", "d-2")):
        pod = worker_pod(name, "decode", cluster, created=f"2026-11-29T10:0{i}:00Z")
        fake.put(f"{PODS}/{name}", pod)
        router.add(name, in_flight=1 if name != "d-1" else 0)
    return cluster


def test_a_shrink_drains_through_the_router_then_names_the_pods(
    api: tuple[FakeApi, Kube], router: RouterStub
) -> None:
    fake, kube = api
    cluster = _start(fake, kube, {"decode": {"replicas": 3}}, router)
    assert _decode_group(fake, cluster)["replicas"] == 3

    kube.scale("kvrelay.io/v1alpha1", "KVRelayPool", "llm", "demo-decode", 2)
    _run(fake, kube, T0 + 10, router)
    # The idle worker's pod is drained first; KubeRay keeps all three for now.
    assert router.drains() == [["d-1"]]
    group = _last_applied_decode_group(fake, cluster)
    assert group["replicas"] == 3 and "scaleStrategy" not in group
    record = fake.objects[SVC]["status"]["scaleDown"]["decode"]
    assert (record["pods"], record["phase"], record["replicas"]) == (["d-1"], "Draining", 2)

    # A request arrives just before the drain flag: still in flight -> still waiting.
    router.set_in_flight("d-1", 1)
    _run(fake, kube, T0 + 20, router)
    assert _last_applied_decode_group(fake, cluster)["replicas"] == 3
    # It finishes: the group shrinks with exactly that pod named.
    router.set_in_flight("d-1", 0)
    _run(fake, kube, T0 + 30, router)
    group = _last_applied_decode_group(fake, cluster)
    assert group["replicas"] == 2
    assert group["scaleStrategy"] == {"workersToDelete": ["d-1"]}
    validate_everywhere(fake.objects[f"{RAYS}/{cluster}"])  # KubeRay's fields, strictly
    assert fake.objects[SVC]["status"]["scaleDown"]["decode"]["phase"] == "Deleting"

    # KubeRay deleted it: the list is dropped and the record cleared.
    del fake.objects[f"{PODS}/d-1"]
    _run(fake, kube, T0 + 40, router)
    group = _last_applied_decode_group(fake, cluster)
    assert group["replicas"] == 2 and "scaleStrategy" not in group
    assert "decode" not in fake.objects[SVC]["status"].get("scaleDown", {})


def test_the_router_api_key_is_sent_with_the_drain(
    api: tuple[FakeApi, Kube], router: RouterStub
) -> None:
    fake, kube = api
    key = "s3cret-key"
    router.api_key = key
    secret = {"data": {"api-key": base64.b64encode(key.encode()).decode()}}
    fake.put("/api/v1/namespaces/llm/secrets/router-key", secret)
    spec = {"decode": {"replicas": 3}, "router": {"apiKeySecret": {"name": "router-key"}}}
    _start(fake, kube, spec, router)
    kube.scale("kvrelay.io/v1alpha1", "KVRelayPool", "llm", "demo-decode", 2)
    _run(fake, kube, T0 + 10, router)
    assert router.drains() == [["d-1"]]
    assert {auth for *_, auth in router.requests} == {f"Bearer {key}"}


def test_a_silent_router_delays_a_shrink_only_until_the_drain_timeout(
    api: tuple[FakeApi, Kube], router: RouterStub
) -> None:
    fake, kube = api
    cluster = _start(fake, kube, {"decode": {"replicas": 3, "drainTimeoutSeconds": 60}}, router)
    kube.scale("kvrelay.io/v1alpha1", "KVRelayPool", "llm", "demo-decode", 2)
    _run(fake, kube, T0 + 10)  # the router is unreachable from here on
    assert _last_applied_decode_group(fake, cluster)["replicas"] == 3
    _run(fake, kube, T0 + 69)
    assert "scaleStrategy" not in _last_applied_decode_group(fake, cluster)
    _run(fake, kube, T0 + 70)
    group = _last_applied_decode_group(fake, cluster)
    assert group["replicas"] == 2 and len(group["scaleStrategy"]["workersToDelete"]) == 1


def _router_pod(name: str, revision: str, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {**labels("demo", "router"), REVISION_LABEL: revision},
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running"}}


def test_a_new_revision_gets_its_own_cluster_and_the_old_one_goes_after_the_routers(
    api: tuple[FakeApi, Kube],
) -> None:
    fake, kube = api
    blue_green = {"strategy": "BlueGreen"}
    old_spec = {"image": "kvrelay:1", "upgrade": blue_green}
    new_spec = {"image": "kvrelay:2", "upgrade": blue_green}
    old_rev, new_rev = revision_hash(service(old_spec)), revision_hash(service(new_spec))
    old, new = f"{RAYS}/{cluster_of(old_spec)}", f"{RAYS}/{cluster_of(new_spec)}"
    fake.put(SVC, service_body(old_spec))
    _run(fake, kube, T0)
    assert fake.objects[SVC]["status"]["generation"] == old_rev
    fake.put(f"{PODS}/router-a", _router_pod("router-a", old_rev))

    # The image changes: a second cluster, the router rolls to it, the old one stays.
    body = service_body(new_spec, generation=2, status=fake.objects[SVC]["status"])
    fake.put(SVC, body)
    _run(fake, kube, T0 + 10)
    assert old in fake.objects and new in fake.objects
    assert fake.objects[new]["metadata"]["labels"][REVISION_LABEL] == new_rev
    deployment = fake.objects["/apis/apps/v1/namespaces/llm/deployments/demo-router"]
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][REVISION_LABEL] == new_rev
    command = template["spec"]["containers"][0]["command"]
    assert (
        command[command.index("--ray-address") + 1]
        == f"ray://{cluster_of(new_spec)}-head-svc:10001"
    )
    assert fake.objects[SVC]["status"]["generation"] == new_rev

    # A new router is up; the old one is terminating (it may still stream): keep its cluster.
    fake.put(f"{PODS}/router-b", _router_pod("router-b", new_rev))
    fake.put(f"{PODS}/router-a", _router_pod("router-a", old_rev, terminating=True))
    _run(fake, kube, T0 + 20)
    assert old in fake.objects
    assert not any(r.method == "DELETE" and r.path == old for r in fake.requests)

    # The last old router is gone: its cluster is deleted, never the serving one.
    del fake.objects[f"{PODS}/router-a"]
    _run(fake, kube, T0 + 30)
    assert old not in fake.objects and new in fake.objects
    _run(fake, kube, T0 + 40)
    assert new in fake.objects


def test_a_cluster_from_before_revisions_goes_once_its_routers_do(
    api: tuple[FakeApi, Kube],
) -> None:
    """An upgrade of the operator itself: the cluster it made before is named after the
    service and carries no revision; its routers neither."""
    fake, kube = api
    legacy = {"metadata": {"name": "demo", "labels": labels("demo", "ray")}, "spec": {}}
    fake.put(f"{RAYS}/demo", legacy)
    legacy_router = {"metadata": {"name": "r-0", "labels": labels("demo", "router")}}
    fake.put(f"{PODS}/r-0", legacy_router)
    fake.put(SVC, service_body({}))
    _run(fake, kube, T0)
    assert f"{RAYS}/demo" in fake.objects
    del fake.objects[f"{PODS}/r-0"]
    _run(fake, kube, T0 + 10)
    assert f"{RAYS}/demo" not in fake.objects
    assert f"{RAYS}/{cluster_of()}" in fake.objects


def test_the_kv_secret_is_created_once_and_mounted(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.put(SVC, service_body({}))
    _run(fake, kube, T0)
    path = "/api/v1/namespaces/llm/secrets/demo-kv"
    secret = fake.objects[path]
    key = base64.b64decode(secret["data"]["secret"])
    assert len(key) == 32
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "KVRelayService"
    _run(fake, kube, T0 + 10)
    assert base64.b64decode(fake.objects[path]["data"]["secret"]) == key
    created = [r.body["metadata"]["name"] for r in fake.requests if r.method == "POST"]
    assert created.count("demo-kv") == 1


def test_a_named_kv_secret_is_used_and_none_is_created(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.put(SVC, service_body({"kvTransfer": {"secretName": "my-kv"}}))
    _run(fake, kube, T0)
    # The Ray token's and the routers' API key's are the only Secrets the operator asks for
    # (ray_access.py, api_key.py).
    asked = {r.path.rsplit("/", 1)[-1] for r in fake.requests if "/secrets" in r.path}
    assert asked == {"demo-ray-auth", "demo-api-key", "secrets"}  # GETs, creates (collection)
    created = [r.body["metadata"]["name"] for r in fake.requests if r.path.endswith("/secrets")]
    assert created == ["demo-ray-auth", "demo-api-key"]
    cluster = fake.objects[f"{RAYS}/{cluster_of({'kvTransfer': {'secretName': 'my-kv'}})}"]
    pod = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-secret"]
    assert volume["secret"]["secretName"] == "my-kv"


def test_no_service_monitor_rights_do_not_wedge_the_reconcile(api: tuple[FakeApi, Kube]) -> None:
    """Defect 5: with rbac.serviceMonitors off, the stale-ServiceMonitor delete is refused
    (403); the reconcile must still write the status and each pool's selector."""
    fake, kube = api
    fake.failures[("DELETE", "/apis/monitoring.coreos.com/v1")] = 403
    fake.put(SVC, service_body({}))
    _run(fake, kube, T0)
    status = fake.objects[SVC]["status"]
    assert status["conditions"][0]["reason"] != "ApplyFailed"
    pool = fake.objects[f"{NS}/kvrelaypools/demo-decode"]
    assert pool["status"]["selector"].endswith("ray.io/group=decode")


def test_without_secret_rights_the_error_says_what_to_do(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.failures[("GET", "/api/v1/namespaces/llm/secrets")] = 403
    fake.put(SVC, service_body({}))
    with pytest.raises(PermanentError, match=r"kvTransfer\.secretName"):
        _run(fake, kube, T0)
    ready = fake.objects[SVC]["status"]["conditions"][0]
    assert (ready["type"], ready["reason"]) == ("Ready", "ApplyFailed")
    assert "rbac.secrets" in ready["message"]
    # With a Secret of its own the service needs no such rights.
    fake.put(SVC, service_body({"kvTransfer": {"secretName": "mine"}}))
    _run(fake, kube, T0 + 10)


def _pool_scaled_handler(registry: Any) -> Any:
    (handler,) = [
        h
        for h in registry._changing.get_all_handlers()
        if h.id.endswith("on_pool_scaled/spec.replicas")
    ]
    return handler.fn


def test_a_scaled_pool_is_rechecked_soon_while_it_drains(
    api: tuple[FakeApi, Kube], router: RouterStub
) -> None:
    """The kopf layer: a shrink waiting for its drain makes kopf retry the pool's handler
    in a few seconds rather than at the next resync; once done, the handler succeeds."""
    import kopf

    from kvrelay_operator.handlers import DRAIN_POLL_SECONDS, OperatorState, build_registry
    from kvrelay_operator.metrics import OperatorMetrics

    fake, kube = api
    _start(fake, kube, {"decode": {"replicas": 3}}, router)
    state = OperatorState(kube, IMAGE, OperatorMetrics(), router_url=lambda _: router.url)
    on_pool_scaled = _pool_scaled_handler(build_registry(30, 15))
    kube.scale("kvrelay.io/v1alpha1", "KVRelayPool", "llm", "demo-decode", 2)
    with pytest.raises(kopf.TemporaryError) as caught:
        on_pool_scaled(spec={"service": "demo"}, namespace="llm", memo=state)
    assert caught.value.delay == DRAIN_POLL_SECONDS
    assert router.drains() == [["d-1"]]
    # Drained: the handler names the pod to KubeRay and still waits for it to go.
    with pytest.raises(kopf.TemporaryError):
        on_pool_scaled(spec={"service": "demo"}, namespace="llm", memo=state)
    del fake.objects[f"{PODS}/d-1"]
    on_pool_scaled(spec={"service": "demo"}, namespace="llm", memo=state)
    assert not fake.objects[SVC]["status"].get("scaleDown")
