"""What the pods get: per-pod identity and the KV address (defect 2), scheduling and pull
secrets (defect 7), GPUs (defect 8), a model that needs no network (defect 10), RDMA / UCX
(defect 12). Every object is validated strictly as it is checked."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.worker.priority import ENGINE_NICENESS, RAY_WORKER_NICENESS_ENV
from kvrelay_operator.desired import desired_objects
from kvrelay_operator.revision import revision_hash
from tests.deploy.schemas import KUBE_VERSIONS, validate_everywhere, validate_object
from tests.operator.services import service

NO_POOLS: dict[str, int | None] = {"prefill": None, "decode": None}
SPREAD = {
    "maxSkew": 1,
    "topologyKey": "topology.kubernetes.io/zone",
    "whenUnsatisfiable": "ScheduleAnyway",
    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}},
}
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
            ]
        }
    }
}
GPU_POOL = {
    "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}},
    "engineArgs": ["--device=cuda"],
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": AFFINITY,
    "topologySpreadConstraints": [SPREAD],
    "priorityClassName": "llm-serving",
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "gpu-registry"}],
}
PRODUCTION: dict[str, Any] = {
    "imagePullSecrets": [{"name": "regcred"}],
    "prefill": GPU_POOL,
    "decode": {**GPU_POOL, "replicas": 2},
    "router": {"priorityClassName": "llm-serving", "imagePullSecrets": [{"name": "regcred"}]},
    "ray": {"head": {"runtimeClassName": "nvidia"}},
    "kvTransfer": {
        "ucx": {"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1"},
        # IPC_LOCK takes effect for root only (rdma.py): the worker container runs as root.
        "rdma": {"resources": {"rdma/rdma_shared_device_a": 1}, "privilege": "Root"},
        "hostNetwork": True,
    },
}


def _templates(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """component -> pod spec, for the router, the head and each worker group."""
    objects = desired_objects(service(spec), NO_POOLS)
    for obj in objects:
        validate_everywhere(obj)
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    router = next(o for o in objects if o["kind"] == "Deployment")
    out = {g["groupName"]: g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]}
    out["head"] = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    out["router"] = router["spec"]["template"]["spec"]
    return out


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}


def test_worker_pods_carry_their_identity_and_bind_the_kv_relay_on_the_pod_ip() -> None:
    spec = service({})
    pods = _templates({})
    for pool in ("prefill", "decode"):
        env = _env(pods[pool])
        assert env["KVRELAY_KV_HOST"] == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}
        }
        assert env["KVRELAY_POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["KVRELAY_NODE_NAME"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["KVRELAY_GENERATION"] == revision_hash(spec)
        assert env["KVRELAY_KV_SECRET_FILE"] == "/var/run/secrets/kvrelay/kv/secret"
        mounts = pods[pool]["containers"][0]["volumeMounts"]
        assert {
            "name": "kv-secret",
            "mountPath": "/var/run/secrets/kvrelay/kv",
            "readOnly": True,
        } in mounts
        (volume,) = [v for v in pods[pool]["volumes"] if v["name"] == "kv-secret"]
        assert volume["secret"]["secretName"] == "demo-kv"
    router_env = _env(pods["router"])
    assert router_env["KVRELAY_GENERATION"] == revision_hash(spec)
    assert router_env["KVRELAY_KV_SECRET_FILE"] == "/var/run/secrets/kvrelay/kv/secret"
    assert "KVRELAY_KV_HOST" not in router_env  # the router serves no KV
    assert "kv-secret" not in {v["name"] for v in pods["head"]["volumes"]}  # nor does the head


def test_worker_pods_run_their_engines_unniced() -> None:
    """Ray starts its workers at nice 15 unless the raylet's environment says otherwise; the
    engines are a worker pod's workload (kvrelay/worker/priority.py)."""
    pods = _templates({})
    for pool in ("prefill", "decode"):
        assert _env(pods[pool])[RAY_WORKER_NICENESS_ENV] == str(ENGINE_NICENESS)


def test_the_kv_secret_env_names_what_the_workers_read() -> None:
    from kvrelay.transfer.kv_secret import KV_SECRET_FILE_ENV
    from kvrelay.transfer.network import KV_HOST_ENV

    env = _env(_templates({})["decode"])
    assert KV_SECRET_FILE_ENV in env and KV_HOST_ENV in env


def test_every_pod_gets_the_scheduling_fields_and_pull_secrets_it_asks_for() -> None:
    pods = _templates(PRODUCTION)
    for pool in ("prefill", "decode"):
        pod = pods[pool]
        # hostNetwork adds one kvrelay worker per node (test_rdma.py) to the pool's own.
        assert {k: v for k, v in pod["affinity"].items() if k != "podAntiAffinity"} == AFFINITY
        assert pod["topologySpreadConstraints"] == [SPREAD]
        assert pod["priorityClassName"] == "llm-serving"
        assert pod["runtimeClassName"] == "nvidia"
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        # The service's secret for every pod, the pool's own besides, no duplicates.
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "gpu-registry"}]
    assert pods["router"]["priorityClassName"] == "llm-serving"
    assert pods["router"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pods["head"]["runtimeClassName"] == "nvidia"
    assert pods["head"]["imagePullSecrets"] == [{"name": "regcred"}]
    plain = _templates({})
    for pod in plain.values():
        for key in ("affinity", "priorityClassName", "runtimeClassName", "imagePullSecrets"):
            assert key not in pod


def test_gpu_workers_request_gpus_from_kubernetes_and_ray() -> None:
    objects = desired_objects(service(PRODUCTION), NO_POOLS)
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert group["rayStartParams"]["num-gpus"] == "1"
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
        env = _env(group["template"]["spec"])
        assert env["KVRELAY_ENGINE_ARGS"] == "--device=cuda"
    cpu = next(o for o in desired_objects(service({}), NO_POOLS) if o["kind"] == "RayCluster")
    assert all("num-gpus" not in g["rayStartParams"] for g in cpu["spec"]["workerGroupSpecs"])


def test_rdma_gives_workers_devices_ipc_lock_ucx_settings_and_host_network() -> None:
    pods = _templates(PRODUCTION)
    for pool in ("prefill", "decode"):
        pod = pods[pool]
        container = pod["containers"][0]
        for kind in ("requests", "limits"):  # extended resources need both, equal
            assert container["resources"][kind]["rdma/rdma_shared_device_a"] == 1
        assert container["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
        assert container["securityContext"]["runAsUser"] == 0
        env = _env(pod)
        assert env["UCX_TLS"] == "rc,cuda_copy"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    # Only the KV pods: the router and head keep least privilege and the pod network.
    for component in ("router", "head"):
        pod = pods[component]
        assert "hostNetwork" not in pod
        assert "add" not in pod["containers"][0]["securityContext"]["capabilities"]
    plain = _templates({})["decode"]
    assert "UCX_TLS" not in _env(plain) and "hostNetwork" not in plain


def test_ipc_lock_can_be_refused_with_rdma_devices() -> None:
    spec = {"kvTransfer": {"rdma": {"resources": {"rdma/hca": 1}, "ipcLock": False}}}
    container = _templates(spec)["decode"]["containers"][0]
    assert "add" not in container["securityContext"]["capabilities"]


@pytest.mark.parametrize(
    ("model", "arg"),
    [
        ({"source": "pvc", "pvc": {"claimName": "models", "path": "llama"}}, "/models/llama"),
        (
            {"source": "image", "image": {"reference": "registry.local/models/llama:3.1"}},
            "/models",
        ),
        (
            {
                "source": "image",
                "image": {"reference": "registry.local/m:1", "path": "hf", "pullPolicy": "Never"},
            },
            "/models/hf",
        ),
    ],
)
def test_a_mounted_model_needs_no_network_at_start(model: dict[str, Any], arg: str) -> None:
    """Defect 10: on an air-gapped cluster nothing may be fetched at pod start; a model on a
    claim or in an image volume is mounted read-only and no init container pulls anything."""
    objects = desired_objects(service({"model": model}), NO_POOLS)
    versions = KUBE_VERSIONS if model["source"] == "pvc" else ("1.31", "1.32", "1.33")
    for obj in objects:
        for version in versions:  # image volumes exist from Kubernetes 1.31
            validate_object(obj, version)
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    router = next(o for o in objects if o["kind"] == "Deployment")
    pods = [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    pods.append(router["spec"]["template"]["spec"])
    for pod in pods:
        assert "initContainers" not in pod
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        if model["source"] == "image":
            assert volume["image"]["reference"] == model["image"]["reference"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in mounts
        assert _env(pod)["HF_HUB_OFFLINE"] == "1"
    command = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--model") + 1] == arg


def test_the_default_model_is_pulled_into_the_cache_and_a_seeded_claim_serves_offline() -> None:
    pod = _templates({"model": {"cacheClaimName": "seeded"}})["decode"]
    (init,) = pod["initContainers"]
    # pull-default is a no-op when the cache holds the model: a claim seeded beforehand
    # (README: air-gapped clusters) makes it work without a network.
    assert init["command"] == ["kvrelay", "model", "pull-default"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "seeded"}} in pod["volumes"]
