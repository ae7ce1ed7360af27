"""Worker revisions (defect 4): the hash changes exactly with what changes an engine, and
old revisions are retired only when no router pod uses them."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay_operator.names import REVISION_LABEL, raycluster_name
from kvrelay_operator.revision import clusters_to_retire, revision_hash, revision_of
from kvrelay_operator.spec import parse_service
from tests.operator.services import IMAGE, service, service_body

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


def test_the_kvrelay_version_changes_the_revision() -> None:
    body = service_body({})
    assert revision_hash(parse_service(body, IMAGE, "1.0.0")) != revision_hash(
        parse_service(body, IMAGE, "1.0.1")
    )


@pytest.mark.parametrize(
    "change",
    [
        {"decode": {"replicas": 5}},
        {"prefill": {"cpusPerWorker": 8}},
        {"router": {"replicas": 4}},
        {"decode": {"resources": {"limits": {"memory": "8Gi"}}}},
        {"decode": {"autoscaling": {"enabled": True}}},
        {"monitoring": {"serviceMonitor": {"enabled": True}}},
    ],
)
def test_sizes_and_placement_do_not(change: dict[str, Any]) -> None:
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
