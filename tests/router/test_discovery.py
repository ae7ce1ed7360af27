"""Worker names per pod (router/discovery.py): a managed worker is named after its Ray node's
host name (KubeRay: the pod's name) and pinned to that node, so a pod that KubeRay re-creates
gets a free name at once; off Kubernetes names stay unique. Node records come from the real
`ray.nodes()` of the session's cluster, so the field names are Ray's own."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import ray

from kvrelay.router.discovery import Slot, worker_name, worker_slots
from tests.worker.conftest import worker_ray

__all__ = ["worker_ray"]


@pytest.fixture(scope="module")
def real_node(worker_ray: None) -> dict[str, Any]:
    """This cluster's one node, as `ray.nodes()` describes it."""
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    assert {"NodeID", "NodeManagerHostname", "Resources", "Alive"} <= set(node)
    return dict(node)


def pod_node(real: dict[str, Any], pod: str, node_id: str, **resources: float) -> dict[str, Any]:
    """`real` as another KubeRay worker pod: its host name, id and custom resources."""
    node = copy.deepcopy(real)
    node.update(NodeManagerHostname=pod, NodeID=node_id)
    node["Resources"] = {**node["Resources"], **resources}
    return node


def test_one_worker_per_pod_offering_the_pool_named_after_the_pod(
    real_node: dict[str, Any],
) -> None:
    nodes = [
        pod_node(real_node, "svc-decode-worker-x7k2p", "a" * 56, kvrelay_decode=1),
        pod_node(real_node, "svc-decode-worker-q9m4t", "b" * 56, kvrelay_decode=1),
        pod_node(real_node, "svc-prefill-worker-h2d8w", "c" * 56, kvrelay_prefill=1),
        real_node,  # the head: no pool resource, no worker
    ]
    assert worker_slots("decode", nodes) == [
        Slot("a" * 56, "kvrelay-decode-svc-decode-worker-x7k2p"),
        Slot("b" * 56, "kvrelay-decode-svc-decode-worker-q9m4t"),
    ]
    assert worker_slots("prefill", nodes) == [
        Slot("c" * 56, "kvrelay-prefill-svc-prefill-worker-h2d8w")
    ]
    assert worker_slots("both", nodes) == []


def test_a_recreated_pod_gets_a_free_name_at_once(real_node: dict[str, Any]) -> None:
    """Before, worker i was `kvrelay-<role>-<i>`: after a scale-down took pod 0, the pod
    KubeRay made in its place wanted `kvrelay-decode-0`, whose old holder (pinned to a dead
    node, restarting) kept the name, so the new worker never started."""
    before = [
        pod_node(real_node, "svc-decode-worker-aaaaa", "a" * 56, kvrelay_decode=1),
        pod_node(real_node, "svc-decode-worker-bbbbb", "b" * 56, kvrelay_decode=1),
    ]
    gone = copy.deepcopy(before[0])
    gone["Alive"] = False
    after = [
        gone,
        before[1],
        pod_node(real_node, "svc-decode-worker-ccccc", "c" * 56, kvrelay_decode=1),
    ]
    old_names = {slot.name for slot in worker_slots("decode", before)}
    new_names = {slot.name for slot in worker_slots("decode", after)}
    assert new_names - old_names == {"kvrelay-decode-svc-decode-worker-ccccc"}
    assert "kvrelay-decode-svc-decode-worker-aaaaa" not in new_names  # dead node: no slot


def test_nodes_sharing_a_host_name_get_unique_names(real_node: dict[str, Any]) -> None:
    """Ray nodes started by hand on one machine share its host name."""
    host = real_node["NodeManagerHostname"]
    nodes = [
        pod_node(real_node, host, "1" * 56, kvrelay_decode=1),
        pod_node(real_node, host, "2" * 56, kvrelay_decode=2),
        pod_node(real_node, "", "3" * 56, kvrelay_decode=1),
    ]
    names = [slot.name for slot in worker_slots("decode", nodes)]
    assert len(set(names)) == 3
    assert names[0] == f"kvrelay-decode-{host}-{'1' * 12}"
    assert names[2] == f"kvrelay-decode-node-{'3' * 12}"


def test_kvrelay_worker_names_its_worker_after_its_pod() -> None:
    assert worker_name("prefill", {"KVRELAY_POD_NAME": "svc-p-worker-abcde"}) == (
        "kvrelay-prefill-svc-p-worker-abcde"
    )
    one, two = worker_name("decode", {}), worker_name("decode", {})
    assert one != two and one.startswith("kvrelay-decode-")  # off Kubernetes: unique
