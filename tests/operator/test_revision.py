"""Worker revisions (defect 4, issue 43): the hash changes exactly with what changes an
engine or a worker pod, and old revisions are retired only when no router pod uses them."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay_operator.names import REVISION_LABEL, raycluster_name
from kvrelay_operator.revision import clusters_to_retire, revision_hash, revision_of
from kvrelay_operator.spec import parse_service
from tests.operator.services import service, service_body

BASE = revision_hash(service({}))


def test_the_hash_is_short_hex_and_stable() -> None:
    assert len(BASE) == 12 and int(BASE, 16) >= 0
    assert revision_hash(service({})) == BASE
    # It names the cluster: <service>-<8 hex>, a DNS label short enough for KubeRay's suffixes.
    assert raycluster_name("demo", BASE) == f"demo-{BASE[:8]}"
    assert len(raycluster_name("x" * 40, BASE) + "-head-svc") <= 63


@pytest.mark.parametrize(
    "change",
    [
        {"image": "kvrelay:other"},
        {"model": {"source": "pvc", "pvc": {"claimName": "m"}}},
        {"model": {"source": "image", "image": {"reference": "r/m:1"}}},
        {"engineArgs": ["--block-size=32"]},
        {"prefill": {"engineArgs": ["--max-num-seqs=8"]}},
        {"decode": {"engineArgs": ["--max-num-seqs=8"]}},
        {"kvTransfer": {"backend": "grpc"}},
        {"ray": {"rayVersion": "2.61.0"}},
    ],
)
def test_what_changes_an_engine_changes_the_revision(change: dict[str, Any]) -> None:
    assert revision_hash(service(change)) != BASE


@pytest.mark.parametrize(
    "change",
    [
        # Every worker pod setting: KubeRay never recreates a running pod when its template
        # changes, so each of these must be a new revision to reach running pods.
        {"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
        {"prefill": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
        {"decode": {"resources": {"limits": {"memory": "8Gi"}}}},
        {"prefill": {"cpusPerWorker": 8}},
        {"kvTransfer": {"ucx": {"tls": "rc,cuda_copy"}}},
        {"kvTransfer": {"ucx": {"netDevices": "mlx5_0:1"}}},
        {"kvTransfer": {"rdma": {"resources": {"rdma/ib": 1}}}},
        {"kvTransfer": {"rdma": {"resources": {"rdma/ib": 1}, "privilege": "Root"}}},
        {"kvTransfer": {"rdma": {"privilege": "FileCapabilities"}}},
        {"kvTransfer": {"rdma": {"privilege": "Root", "memlock": "Unlimited"}}},
        {"kvTransfer": {"rdma": {"hugepages": {"size": "2Gi"}}}},
        {"kvTransfer": {"ucx": {"env": {"UCX_RNDV_THRESH": "8192"}}}},
        {"kvTransfer": {"workerEnv": {"NCCL_DEBUG": "INFO"}}},
        {"kvTransfer": {"shm": {"sizeLimit": "16Gi"}}},
        {"kvTransfer": {"hostNetwork": True}},
        {"imagePullSecrets": [{"name": "regcred"}]},
        {"decode": {"imagePullSecrets": [{"name": "regcred"}]}},
        {"decode": {"nodeSelector": {"gpu": "h100"}}},
        {"prefill": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}},
        {"decode": {"priorityClassName": "serving"}},
        {"decode": {"runtimeClassName": "nvidia"}},
        {"imagePullPolicy": "Always"},
        {"ray": {"head": {"resources": {"limits": {"cpu": "4"}}}}},
    ],
)
def test_every_worker_pod_setting_changes_the_revision(change: dict[str, Any]) -> None:
    assert revision_hash(service(change)) != BASE


def test_a_pod_setting_added_later_is_covered_without_listing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hash is over the rendered pod templates, not a hand-kept list of fields: a new
    env variable (or volume, capability...) that podparts.py starts to render is a new
    revision with no change to revision.py."""
    from kvrelay_operator import podparts

    render = podparts.worker_env

    def with_more(spec: Any) -> list[dict[str, Any]]:
        return [*render(spec), {"name": "UCX_RNDV_THRESH", "value": "8192"}]

    monkeypatch.setattr(podparts, "worker_env", with_more)
    assert revision_hash(service({})) != BASE


def test_an_operator_upgrade_that_renders_the_same_pods_rolls_nothing() -> None:
    """The operator's own kvrelay version is no input: what it puts into pods is (upgrade.py),
    so a `helm upgrade` of the operator alone does not roll a service that pins its image."""
    body = service_body({"image": "registry.example/kvrelay:0.1.0"})
    before = revision_hash(parse_service(body, "registry.example/kvrelay:0.1.0", "1.0.0"))
    after = revision_hash(parse_service(body, "registry.example/kvrelay:0.2.0", "1.0.1"))
    assert before == after


def test_a_new_operator_default_image_rolls_only_the_services_that_follow_it() -> None:
    """`spec.image` empty: the service takes the operator's default image, and a new default
    is a new revision; a pinned `spec.image` decides for itself."""
    follows, pins = service_body({}), service_body({"image": "registry.example/kvrelay:0.1.0"})
    old, new = "registry.example/kvrelay:0.1.0", "registry.example/kvrelay:0.2.0"
    assert revision_hash(parse_service(follows, old)) != revision_hash(parse_service(follows, new))
    assert revision_hash(parse_service(pins, old)) == revision_hash(parse_service(pins, new))


@pytest.mark.parametrize(
    "change",
    [
        {"decode": {"replicas": 5}},
        {"router": {"replicas": 4}},
        {"router": {"resources": {"limits": {"cpu": "2"}}}},
        {"decode": {"autoscaling": {"enabled": True, "maxReplicas": 9}}},
        {"decode": {"drainTimeoutSeconds": 60}},
        {"monitoring": {"serviceMonitor": {"enabled": True}}},
        {"upgrade": {"strategy": "BlueGreen", "maxSurge": 3}},
    ],
)
def test_sizes_and_router_settings_do_not(change: dict[str, Any]) -> None:
    """A resize is drained in place (drain.py); the router Deployment rolls its own pods."""
    assert revision_hash(service(change)) == BASE


def _obj(name: str, revision: str | None, terminating: bool = False) -> dict[str, Any]:
    labels = {} if revision is None else {REVISION_LABEL: revision}
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if terminating:
        meta["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    return {"metadata": meta}


def test_the_names_running_deployments_carry_stay() -> None:
    """The code says "revision"; the label key and the status field keep "generation"."""
    assert REVISION_LABEL == "kvrelay.io/generation"


def test_revision_of_reads_the_label() -> None:
    assert revision_of(_obj("a", "abc")) == "abc"
    assert revision_of(_obj("a", None)) == ""
    assert revision_of({}) == ""


def test_two_revisions_old_one_retired_only_without_routers() -> None:
    clusters = [_obj("demo-aaaa", "aaaa"), _obj("demo-bbbb", "bbbb")]
    # A router of each: both stay.
    routers = [_obj("r1", "aaaa"), _obj("r2", "bbbb")]
    assert clusters_to_retire(clusters, routers, "bbbb") == []
    # The old router is terminating but still exists (it may stream): stays.
    routers = [_obj("r1", "aaaa", terminating=True), _obj("r2", "bbbb")]
    assert clusters_to_retire(clusters, routers, "bbbb") == []
    # Gone: retire it. The serving revision's cluster is never retired, routers or not.
    assert clusters_to_retire(clusters, [_obj("r2", "bbbb")], "bbbb") == ["demo-aaaa"]
    assert clusters_to_retire(clusters, [], "bbbb") == ["demo-aaaa"]


def test_a_rollback_keeps_the_cluster_it_returns_to() -> None:
    clusters = [_obj("demo-aaaa", "aaaa"), _obj("demo-bbbb", "bbbb")]
    routers = [_obj("r2", "bbbb")]
    assert clusters_to_retire(clusters, routers, "aaaa") == []
    assert clusters_to_retire(clusters, [_obj("r1", "aaaa")], "aaaa") == ["demo-bbbb"]
