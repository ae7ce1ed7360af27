"""A whole GPU deployment, end to end on paper: the chart rendered by Helm with an example
KVRelayService on GPUs with RDMA, that service reconciled by the operator's own code
against the fake API server through two revisions (an image upgrade while the old
routers still run), and every object that results validated strictly: built-in kinds with
kubernetes-validate for each Kubernetes version, the RayClusters against KubeRay's fields,
our custom resources against their CRDs. These are the objects docs/deploy.md names."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from kvrelay_operator.names import REVISION_LABEL, labels
from kvrelay_operator.reconcile import reconcile
from kvrelay_operator.revision import revision_hash
from kvrelay_operator.spec import parse_service
from tests.deploy.schemas import CHART, KUBE_VERSIONS, validate_custom, validate_object
from tests.operator.fake_api import FakeApi, fake_api

Obj = dict[str, Any]
T0 = 1_800_000_000.0
RDMA = {
    "ucx": {"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1"},
    "rdma": {"resources": {"rdma/rdma_shared_device_a": 1}, "privilege": "Root"},
}
VALUES: Obj = {
    "imagePullSecrets": [{"name": "regcred"}],
    "example": {"enabled": True, "name": "chat"},
}


def _render(values: Obj) -> list[Obj]:
    with helm.Chart.load(CHART) as chart:
        defaults = yaml.safe_load((CHART / "values.yaml").read_text())
        example = copy.deepcopy(defaults["example"]["spec"])
        example["kvTransfer"].update(RDMA)
        example["imagePullSecrets"] = [{"name": "regcred"}]
        merged = {**values, "example": {**values["example"], "spec": example}}
        manifests = chart.render(values=merged, name="kv", namespace="llm", is_install=True)
    objects: list[Obj] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


@pytest.fixture(scope="module")
def deployment() -> Iterator[dict[str, Any]]:
    """The chart's objects, and the operator's after two revisions, by kind."""
    chart_objects = _render(VALUES)
    (service,) = [o for o in chart_objects if o["kind"] == "KVRelayService"]
    body = validate_custom({**service, "metadata": {**service["metadata"], "uid": "u-1"}})
    body["metadata"]["generation"] = 1
    image = "registry.local/kvrelay:0.1.0"
    with fake_api() as (fake, kube):
        path = "/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/chat"
        fake.put(path, body)
        reconcile(kube, fake.objects[path], image, T0, router_url=lambda _: "http://127.0.0.1:9")
        old = revision_hash(parse_service(body, image))
        _router_pod(fake, "chat-router-old", old)
        upgraded = copy.deepcopy(fake.objects[path])
        upgraded["spec"]["image"] = "registry.local/kvrelay:0.2.0"
        # Blue/green: both revisions at full size in one reconcile, every object to check
        # (tests/operator/test_rolling_upgrade.py walks a Rolling upgrade step by step).
        upgraded["spec"]["upgrade"] = {"strategy": "BlueGreen"}
        upgraded["metadata"]["generation"] = 2
        fake.put(path, upgraded)
        reconcile(
            kube, fake.objects[path], image, T0 + 60, router_url=lambda _: "http://127.0.0.1:9"
        )
        new = revision_hash(parse_service(upgraded, image))
        operator_objects = [
            o for p, o in fake.objects.items() if "/pods/" not in p and "/kvrelayservices/" not in p
        ]
    yield {
        "chart": chart_objects,
        "operator": operator_objects,
        "service": fake.objects[path],
        "revisions": (old, new),
    }


def _router_pod(fake: FakeApi, name: str, revision: str) -> None:
    meta = {"name": name, "labels": {**labels("chat", "router"), REVISION_LABEL: revision}}
    fake.put(f"/api/v1/namespaces/llm/pods/{name}", {"metadata": meta})


def _kinds(objects: list[Obj]) -> dict[str, list[Obj]]:
    out: dict[str, list[Obj]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_is_strictly_valid(deployment: dict[str, Any], version: str) -> None:
    objects = deployment["chart"] + deployment["operator"]
    assert len(objects) > 20
    for obj in objects:
        validate_object(obj, version)


def test_the_chart_gives_the_example_gpus(deployment: dict[str, Any]) -> None:
    (service,) = _kinds(deployment["chart"])["KVRelayService"]
    for pool in ("prefill", "decode"):
        assert service["spec"][pool]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert service["spec"]["engineArgs"] == ["--device=cuda"]


def test_two_revisions_run_side_by_side_during_the_upgrade(deployment: dict[str, Any]) -> None:
    old, new = deployment["revisions"]
    assert old != new
    kinds = _kinds(deployment["operator"])
    clusters = {c["metadata"]["name"]: c for c in kinds["RayCluster"]}
    assert sorted(clusters) == sorted([f"chat-{old[:8]}", f"chat-{new[:8]}"])
    for name, cluster in clusters.items():
        revision = cluster["metadata"]["labels"][REVISION_LABEL]
        assert name == f"chat-{revision[:8]}"
        for group in cluster["spec"]["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            (container,) = pod["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["KVRELAY_GENERATION"] == revision
            assert env["UCX_TLS"] == "rc,cuda_copy"
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
            assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
            assert pod["imagePullSecrets"] == [{"name": "regcred"}]
            assert group["rayStartParams"]["num-gpus"] == "1"
    # The router rolled to the new revision's cluster.
    (router,) = kinds["Deployment"]
    template = router["spec"]["template"]
    assert template["metadata"]["labels"][REVISION_LABEL] == new
    assert f"ray://chat-{new[:8]}-head-svc:10001" in template["spec"]["containers"][0]["command"]
    assert deployment["service"]["status"]["generation"] == new


def test_the_operator_makes_exactly_these_objects(deployment: dict[str, Any]) -> None:
    """docs/deploy.md ("What the chart installs") names these; keep both in step."""
    names = sorted((o["kind"], o["metadata"]["name"]) for o in deployment["operator"])
    old, new = deployment["revisions"]
    assert names == sorted(
        [
            ("Deployment", "chat-router"),
            ("KVRelayPool", "chat-decode"),
            ("KVRelayPool", "chat-prefill"),
            ("NetworkPolicy", "chat-ray"),
            ("PodDisruptionBudget", "chat-decode"),
            ("PodDisruptionBudget", "chat-prefill"),
            ("PodDisruptionBudget", "chat-router"),
            ("RayCluster", f"chat-{new[:8]}"),
            ("RayCluster", f"chat-{old[:8]}"),
            ("Secret", "chat-api-key"),  # the example names no apiKeySecret
            ("Secret", "chat-kv"),
            ("Secret", "chat-ray-auth"),
            ("Service", "chat-router"),
        ]
    )


def _documented_service() -> Obj:
    """The GPU KVRelayService `chat` that docs/deploy.md shows (beside a CPU one, `demo`)."""
    text = (CHART.parents[2] / "docs" / "deploy.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```yaml\n")[1:]]
    services = [yaml.safe_load(b) for b in blocks if "kind: KVRelayService" in b]
    (service,) = [s for s in services if s["metadata"]["name"] == "chat"]
    return dict(service)


def test_the_documented_example_is_valid_and_makes_the_objects_it_names() -> None:
    from kvrelay_operator.desired import desired_objects

    service = _documented_service()
    assert service["metadata"]["name"] == "chat"
    body = validate_custom(
        {**service, "metadata": {**service["metadata"], "namespace": "default", "uid": "u"}}
    )
    spec = parse_service(body, "unused")
    objects = desired_objects(spec, {"prefill": None, "decode": None})
    for obj in objects:
        for version in KUBE_VERSIONS:
            validate_object(obj, version)
    revision = revision_hash(spec)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("RayCluster", f"chat-{revision[:8]}") in names
    assert {("Deployment", "chat-router"), ("Service", "chat-router")} <= names
    assert {("KVRelayPool", "chat-prefill"), ("KVRelayPool", "chat-decode")} <= names
