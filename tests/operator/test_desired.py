"""A KVRelayService -> its desired children: shapes, contracts, validity, ownership."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvrelay_operator.desired import (
    apply_body,
    changed_objects,
    desired_objects,
    object_key,
    stale_kinds,
)
from kvrelay_operator.names import raycluster_name
from kvrelay_operator.raycluster import ray_resources_param
from kvrelay_operator.revision import revision_hash
from kvrelay_operator.router_deployment import router_command
from tests.deploy.schemas import validate_everywhere
from tests.operator.services import IMAGE, service

NO_POOLS: dict[str, int | None] = {"prefill": None, "decode": None}

SPECS: dict[str, dict[str, Any]] = {
    "empty": {},
    "pvc-model-grpc-lb": {
        "model": {"source": "pvc", "pvc": {"claimName": "models", "path": "llama-3b"}},
        "kvTransfer": {"backend": "grpc"},
        "router": {"replicas": 3, "serviceType": "LoadBalancer"},
    },
    "folder-model-api-key": {
        "model": {"source": "folder", "folder": {"path": "/opt/models/smol"}},
        "router": {"apiKeySecret": {"name": "kv-key"}},
    },
    "placed-autoscaled-monitored": {
        "image": "other/kvrelay:dev",
        "model": {"cacheClaimName": "kv-cache"},
        "engineArgs": ["--block-size=16"],
        "prefill": {
            "replicas": 2,
            "cpusPerWorker": 4,
            "engineArgs": ["--max-num-batched-tokens=1024", "--no-prefix-caching"],
            "resources": {"requests": {"cpu": 4, "memory": "16Gi"}, "limits": {"memory": "20Gi"}},
            "nodeSelector": {"pool": "prefill"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8},
        },
        "decode": {
            "replicas": 0,
            "autoscaling": {"enabled": True, "metric": "kvUsage", "target": "0.8"},
        },
        "ray": {"head": {"resources": {"requests": {"cpu": "500m"}}}},
        "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
}


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_child_is_valid_owned_and_labelled(case: str) -> None:
    spec = service(SPECS[case])
    objects = desired_objects(spec, NO_POOLS)
    kinds = _by_kind(objects)
    assert len(kinds["KVRelayPool"]) == 2
    assert len(kinds["PodDisruptionBudget"]) == 3
    assert [o["kind"] for o in objects if o["kind"] in ("RayCluster", "Deployment", "Service")] == [
        "RayCluster",
        "Deployment",
        "Service",
    ]
    assert ("ServiceMonitor" in kinds) == spec.service_monitor
    for obj in objects:
        validate_everywhere(obj)
        meta = obj["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvrelay.io/v1alpha1",
                "kind": "KVRelayService",
                "name": "demo",
                "uid": "uid-1234",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/instance"] == "demo"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvrelay-operator"
    # Names are unique per kind (one namespace).
    keys = [object_key(o) for o in objects]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("case", "model", "extra"),
    [
        ("empty", "default", []),
        ("pvc-model-grpc-lb", "/models/llama-3b", []),
        ("folder-model-api-key", "/opt/models/smol", []),
        ("placed-autoscaled-monitored", "default", ["--block-size=16"]),
    ],
)
def test_router_command_follows_the_contract(case: str, model: str, extra: list[str]) -> None:
    spec = service(SPECS[case])
    backend = "grpc" if case == "pvc-model-grpc-lb" else "nixl"
    revision = revision_hash(spec)
    assert router_command(spec, revision) == [
        "kvrelay",
        "router",
        "--ray-address",
        f"ray://demo-{revision[:8]}-head-svc:10001",
        "--model",
        model,
        "--http-host",
        "0.0.0.0",
        "--http-port",
        "8000",
        "--grpc-host",
        "0.0.0.0",
        "--grpc-port",
        "50051",
        "--manage-workers",
        "--transfer-backend",
        backend,
        "--api-key-env",  # always: the service's Secret or the operator's (api_key.py)
        "KVRELAY_API_KEY",
        *extra,
    ]


def test_ray_resources_param_is_the_quoted_json_kuberay_passes_on() -> None:
    assert ray_resources_param("prefill") == '"{\\"kvrelay_prefill\\": 1}"'
    assert json.loads(json.loads(ray_resources_param("decode"))) == {"kvrelay_decode": 1}


def test_raycluster_groups_carry_pool_resources_and_placement() -> None:
    spec = service(SPECS["placed-autoscaled-monitored"])
    (cluster,) = _by_kind(desired_objects(spec, {"prefill": 3, "decode": None}))["RayCluster"]
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head runs no engine
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    prefill, decode = cluster["spec"]["workerGroupSpecs"]
    assert (prefill["groupName"], prefill["replicas"], prefill["maxReplicas"]) == ("prefill", 3, 8)
    assert (decode["groupName"], decode["replicas"]) == ("decode", 0)
    assert prefill["rayStartParams"] == {
        "num-cpus": "4",
        "resources": ray_resources_param("prefill"),
    }
    pod = prefill["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "prefill"}
    assert pod["tolerations"][0]["key"] == "gpu"
    (container,) = pod["containers"]
    assert container["image"] == "other/kvrelay:dev"
    assert container["resources"]["requests"] == {"cpu": 4, "memory": "16Gi"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVRELAY_ENGINE_ARGS"] == "--max-num-batched-tokens=1024 --no-prefix-caching"
    assert env["KVRELAY_CACHE_DIR"] == "/var/cache/kvrelay"
    # The default model is fetched by an init container into the shared cache claim.
    assert pod["initContainers"][0]["command"] == ["kvrelay", "model", "pull-default"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "kv-cache"}} in pod["volumes"]
    assert "nodeSelector" not in decode["template"]["spec"]


def test_pvc_model_is_mounted_read_only_everywhere_and_needs_no_pull() -> None:
    spec = service(SPECS["pvc-model-grpc-lb"])
    objects = desired_objects(spec, NO_POOLS)
    kinds = _by_kind(objects)
    (cluster,) = kinds["RayCluster"]
    (deployment,) = kinds["Deployment"]
    templates = [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    templates += [cluster["spec"]["headGroupSpec"]["template"], deployment["spec"]["template"]]
    for template in templates:
        pod = template["spec"]
        assert "initContainers" not in pod
        assert {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
        } in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in mounts
    (svc,) = kinds["Service"]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert deployment["spec"]["replicas"] == 3


def test_router_reads_the_api_key_from_the_secret() -> None:
    spec = service(SPECS["folder-model-api-key"])
    (deployment,) = _by_kind(desired_objects(spec, NO_POOLS))["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (key_env,) = [e for e in container["env"] if e["name"] == "KVRELAY_API_KEY"]
    assert key_env["valueFrom"] == {"secretKeyRef": {"name": "kv-key", "key": "api-key"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "tcpSocket" in container["livenessProbe"]  # 503 without workers must not restart it


def test_no_api_key_secret_means_the_operators_generated_one() -> None:
    spec = service({})
    (deployment,) = _by_kind(desired_objects(spec, NO_POOLS))["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (key_env,) = [e for e in container["env"] if e["name"] == "KVRELAY_API_KEY"]
    assert key_env["valueFrom"] == {"secretKeyRef": {"name": "demo-api-key", "key": "api-key"}}


@pytest.mark.parametrize(
    ("observed", "expected"),
    [
        ({"prefill": None, "decode": None}, (2, 0)),  # new pools start at the spec's counts
        ({"prefill": 5, "decode": 3}, (5, 3)),  # scaled pools keep their size
        ({"prefill": 0, "decode": None}, (0, 0)),
    ],
)
def test_pool_sizes_come_from_the_pools_once_they_exist(
    observed: dict[str, int | None], expected: tuple[int, int]
) -> None:
    spec = service(SPECS["placed-autoscaled-monitored"])
    kinds = _by_kind(desired_objects(spec, observed))
    pools = {p["spec"]["pool"]: p["spec"]["replicas"] for p in kinds["KVRelayPool"]}
    groups = {
        g["groupName"]: g["replicas"] for g in kinds["RayCluster"][0]["spec"]["workerGroupSpecs"]
    }
    assert (pools["prefill"], pools["decode"]) == expected
    assert (groups["prefill"], groups["decode"]) == expected


def test_apply_body_leaves_pool_replicas_to_whoever_scales() -> None:
    objects = desired_objects(service({}), NO_POOLS)
    for obj in objects:
        body = apply_body(obj)
        if obj["kind"] == "KVRelayPool":
            assert "replicas" not in body["spec"]
            assert obj["spec"]["replicas"] == 1  # the original is untouched
        else:
            assert body is obj


def test_service_monitor_is_deleted_when_turned_off() -> None:
    assert stale_kinds(service({})) == [
        ("monitoring.coreos.com/v1", "ServiceMonitor", "demo-router")
    ]
    on = service({"monitoring": {"serviceMonitor": {"enabled": True}}})
    assert stale_kinds(on) == []


OLD = "old"  # stands for the RayCluster of the spec before the change
NEW = "new"  # and of the spec after it


@pytest.mark.parametrize(
    ("change", "changed"),
    [
        ({}, []),
        ({"router": {"replicas": 4}}, [("apps/v1", "Deployment", "demo-router")]),
        ({"router": {"serviceType": "NodePort"}}, [("v1", "Service", "demo-router")]),
        # A worker pod setting is a new revision too: KubeRay never recreates running pods,
        # so an in-place template change would never reach them (revision.py).
        (
            {"decode": {"cpusPerWorker": 8}},
            [
                ("apps/v1", "Deployment", "demo-router"),
                ("ray.io/v1", "RayCluster", OLD),
                ("ray.io/v1", "RayCluster", NEW),
            ],
        ),
        # A new revision: a new RayCluster beside the old, and the router rolls to it.
        (
            {"kvTransfer": {"backend": "grpc"}},
            [
                ("apps/v1", "Deployment", "demo-router"),
                ("ray.io/v1", "RayCluster", OLD),
                ("ray.io/v1", "RayCluster", NEW),
            ],
        ),
        (
            {"image": "kvrelay:new"},
            [
                ("apps/v1", "Deployment", "demo-router"),
                ("ray.io/v1", "RayCluster", OLD),
                ("ray.io/v1", "RayCluster", NEW),
            ],
        ),
        (
            {"monitoring": {"serviceMonitor": {"enabled": True}}},
            [("monitoring.coreos.com/v1", "ServiceMonitor", "demo-router")],
        ),
        # A pool's initial count only matters at creation: existing pools keep their size.
        ({"decode": {"replicas": 7}}, []),
    ],
)
def test_a_spec_change_changes_only_the_objects_it_should(
    change: dict[str, Any], changed: list[tuple[str, str, str]]
) -> None:
    observed: dict[str, int | None] = {"prefill": 1, "decode": 1}
    old, new = service({}), service(change, generation=2)
    names = {
        OLD: raycluster_name("demo", revision_hash(old)),
        NEW: raycluster_name("demo", revision_hash(new)),
    }
    before = desired_objects(old, observed)
    after = desired_objects(new, observed)
    expected = [(a, k, names.get(n, n)) for a, k, n in changed]
    assert changed_objects(before, after) == sorted(expected)


def test_default_image_is_used_when_the_service_names_none() -> None:
    (deployment,) = _by_kind(desired_objects(service({}), NO_POOLS))["Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
