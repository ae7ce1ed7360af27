"""Pieces every kvrelay pod shares: the model and cache volumes, env, security, placement.

Pure builders over a `ServiceSpec`; the router and the Ray worker groups assemble their pod
templates from these so that every pod sees the model at the same path.
"""

from __future__ import annotations

from typing import Any

from kvrelay_operator import model_cache, rdma
from kvrelay_operator.env import (
    CACHE_DIR_ENV,
    COMPONENT_ENV,
    GENERATION_ENV,
    KV_HOST_ENV,
    KV_SECRET_FILE_ENV,
    NODE_NAME_ENV,
    POD_NAME_ENV,
    SERVICE_ENV,
)
from kvrelay_operator.names import (
    CACHE_DIR,
    HUB_CACHE_DIR,
    KV_SECRET_KEY,
    KV_SECRET_MOUNT,
    MODEL_MOUNT,
    kv_secret_name,
    labels,
)
from kvrelay_operator.spec import Placement, ServiceSpec

Obj = dict[str, Any]

# The image's unprivileged user (see the Dockerfile); fsGroup lets it write the cache volume.
RUN_AS_USER = 1000


def model_arg(spec: ServiceSpec) -> str:
    """The `--model` value every kvrelay process gets."""
    model = spec.model
    if model.source == "pvc":
        return f"{MODEL_MOUNT}/{model.pvc_path}".rstrip("/")
    if model.source == "image":
        return f"{MODEL_MOUNT}/{model.image_path}".rstrip("/")
    if model.source == "folder":
        return model.folder
    if model.source == "hub":
        return f"{model.hub_id}@{model.hub_revision}"
    return "default"


def _model_volume(spec: ServiceSpec) -> Obj | None:
    model = spec.model
    if model.source == "pvc":
        claim = {"claimName": model.pvc_claim, "readOnly": True}
        return {"name": "model", "persistentVolumeClaim": claim}
    if model.source == "image":
        # An image volume (Kubernetes' ImageVolume feature): the model ships as an OCI image
        # in the cluster's own registry, pulled like any image: nothing is fetched at start.
        image = {"reference": model.image_ref, "pullPolicy": model.image_pull_policy}
        return {"name": "model", "image": image}
    return None


def kv_secret(spec: ServiceSpec) -> str:
    """The Secret holding the KV transfer key: the service's own, or the one we create."""
    return spec.kv.secret_name or kv_secret_name(spec.name)


def volumes(spec: ServiceSpec, kv: bool = False) -> list[Obj]:
    """The pod's volumes: the cache, the model when it is a volume, and (`kv`) the KV secret."""
    cache: Obj = (
        {"name": "cache", "persistentVolumeClaim": {"claimName": spec.model.cache_claim}}
        if spec.model.cache_claim
        else {"name": "cache", "emptyDir": {}}
    )
    out = [cache]
    model = _model_volume(spec)
    if model is not None:
        out.append(model)
    if model_cache.enabled(spec):
        out.append(model_cache.volume(spec))
    if kv:
        secret = {
            "secretName": kv_secret(spec),
            "items": [{"key": KV_SECRET_KEY, "path": KV_SECRET_KEY}],
            "defaultMode": 0o440,
        }
        out.append({"name": "kv-secret", "secret": secret})
    return out


def volume_mounts(spec: ServiceSpec, kv: bool = False) -> list[Obj]:
    out: list[Obj] = [{"name": "cache", "mountPath": CACHE_DIR}]
    if spec.model.mounted:
        out.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if model_cache.enabled(spec):
        out.append(model_cache.mount(read_only=True))
    if kv:
        out.append({"name": "kv-secret", "mountPath": KV_SECRET_MOUNT, "readOnly": True})
    return out


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def base_env(spec: ServiceSpec, component: str, revision: str) -> list[Obj]:
    env = [
        {"name": CACHE_DIR_ENV, "value": CACHE_DIR},
        {"name": COMPONENT_ENV, "value": component},
        {"name": SERVICE_ENV, "value": spec.name},
        {"name": GENERATION_ENV, "value": revision},
        # Nothing is fetched from a model hub at run time (air-gapped clusters included): a
        # `source: hub` model is pulled by the init container (init_containers) beforehand.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # Ray and torch size their thread pools from the node; keep them to the pod's share.
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]
    if spec.model.source == "hub":
        env.append({"name": "HF_HUB_CACHE", "value": HUB_CACHE_DIR})
    return env


def kv_env(spec: ServiceSpec) -> list[Obj]:
    """What a pod that starts or hosts engines needs for the KV relay: the shared secret."""
    return [{"name": KV_SECRET_FILE_ENV, "value": f"{KV_SECRET_MOUNT}/{KV_SECRET_KEY}"}]


def worker_env(spec: ServiceSpec) -> list[Obj]:
    """Per-pod identity and the KV relay's address and transport settings of a worker pod.

    The engine actors inherit the raylet's environment: they name themselves after the pod,
    bind and advertise the KV servers on the pod IP (never 127.0.0.1, which peers in other
    pods cannot reach) and hand UCX its settings.
    """
    env = [
        _field_env(POD_NAME_ENV, "metadata.name"),
        _field_env(NODE_NAME_ENV, "spec.nodeName"),
        _field_env(KV_HOST_ENV, "status.podIP"),
        *kv_env(spec),
        # Ray starts its workers at nice 15; the engines are the pod's workload (see
        # kvrelay/worker/priority.py).
        {"name": "RAY_worker_niceness", "value": "0"},
    ]
    if spec.kv.ucx_tls:
        env.append({"name": "UCX_TLS", "value": spec.kv.ucx_tls})
    if spec.kv.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": spec.kv.ucx_net_devices})
    return env


def container_security(ipc_lock: bool = False) -> Obj:
    """Least privilege; `ipc_lock` adds CAP_IPC_LOCK, which RDMA needs to pin memory."""
    capabilities: Obj = {"drop": ["ALL"]}
    if ipc_lock:
        capabilities["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": capabilities,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER}


def init_containers(spec: ServiceSpec, resources: Obj) -> list[Obj]:
    """Fetch the default model, or a `source: hub` model's snapshot, into the cache before
    the engine starts (a no-op once cached, so a cache claim seeded beforehand works without
    a network). Models on a volume or in the image need nothing; a shared cache
    (model_cache.py) is filled by its Job, which the pod waits for."""
    if model_cache.enabled(spec):
        return [model_cache.wait_container(spec, container_security(), resources)]
    if spec.model.source == "default":
        command = ["kvrelay", "model", "pull-default"]
        env = [{"name": CACHE_DIR_ENV, "value": CACHE_DIR}]
    elif spec.model.source == "hub":
        command = ["kvrelay", "model", "pull", model_arg(spec), *_quantization(spec)]
        env = [{"name": "HF_HUB_CACHE", "value": HUB_CACHE_DIR}, *_hub_token_env(spec)]
    else:
        return []
    return [
        {
            "name": "pull-model",
            "image": spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": command,
            "env": env,
            "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}],
            "resources": resources,
            "securityContext": container_security(),
        }
    ]


def _hub_token_env(spec: ServiceSpec) -> list[Obj]:
    """HF_TOKEN from the service's token Secret, for the pull only (the serving containers
    never see it: they read the cache offline)."""
    model = spec.model
    if not model.hub_token_secret:
        return []
    ref = {"name": model.hub_token_secret, "key": model.hub_token_key}
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]


def _quantization(spec: ServiceSpec) -> list[str]:
    """The service's --quantization (engineArgs are `--flag=value`, the CRD says), which
    decides whether the pull fetches the GGUF."""
    return [arg for arg in spec.engine_args if arg.startswith("--quantization=")][-1:]


def place(pod_spec: Obj, placement: Placement, spec: ServiceSpec) -> Obj:
    """Add the scheduling and runtime fields that are set (unset ones stay out, keeping
    diffs small) and the pull secrets of the service and the group."""
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in placement.tolerations]
    if placement.affinity:
        pod_spec["affinity"] = dict(placement.affinity)
    if placement.topology_spread:
        pod_spec["topologySpreadConstraints"] = [dict(t) for t in placement.topology_spread]
    if placement.priority_class:
        pod_spec["priorityClassName"] = placement.priority_class
    if placement.runtime_class:
        pod_spec["runtimeClassName"] = placement.runtime_class
    secrets = list(dict.fromkeys([*spec.pull_secrets, *placement.pull_secrets]))
    if secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in secrets]
    return pod_spec


def resources(placement: Placement, extra: Obj | None = None) -> Obj:
    """A container's resources; `extra` (RDMA devices) is added to requests and limits, as
    extended resources must be."""
    out: Obj = {k: dict(v) for k, v in placement.resources.items() if v}
    if extra:
        for kind in ("requests", "limits"):
            out[kind] = {**out.get(kind, {}), **extra}
    return out


def worker_transport(template: Obj, spec: ServiceSpec) -> Obj:
    """`template` (a worker group's pod template) with the KV transport's pod settings:
    the RDMA privilege, /dev/shm, hugepages, `UCX_*` and extra env, memlock, and for
    hostNetwork the node's network with one kvrelay worker per node (rdma.py says why)."""
    settings = spec.kv.transport
    pod = template["spec"]
    container = pod["containers"][0]
    container["securityContext"] = rdma.container_security(settings, container["securityContext"])
    extra_volumes, mounts = rdma.volumes(settings)
    pod["volumes"] = [*pod["volumes"], *extra_volumes]
    container["volumeMounts"] = [*container["volumeMounts"], *mounts]
    container["env"] = [*container["env"], *rdma.worker_env(settings)]
    huge = rdma.hugepage_resources(settings)
    for kind in ("requests", "limits") if huge else ():
        container.setdefault("resources", {}).setdefault(kind, {}).update(huge)
    if spec.kv.host_network:
        # RDMA NICs without a CNI that hands them to pods: the pod uses the node's network.
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
        pod["affinity"] = rdma.host_network_anti_affinity(pod.get("affinity") or {})
    if settings.memlock == "Unlimited":
        template["metadata"].setdefault("annotations", {})[rdma.OVERWRITE_CMD] = "true"
        container["command"] = ["/bin/bash", "-c", "--"]
        container["args"] = [rdma.MEMLOCK_ARGS]
    return template


def model_cache_objects(spec: ServiceSpec) -> list[Obj]:
    """The shared model cache's claim (unless the service names one) and the Job that fills
    it, scheduled like the router (same placement and pull secrets); none without a cache."""
    if not model_cache.enabled(spec):
        return []
    claim = model_cache.desired_claim(spec)
    container = {
        "name": "fill-model-cache",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": model_cache.fill_command(),
        "env": [{"name": CACHE_DIR_ENV, "value": CACHE_DIR}],
        "volumeMounts": [model_cache.mount(read_only=False)],
        "resources": resources(spec.router.placement),
        "securityContext": container_security(),
    }
    pod = place(
        {
            "restartPolicy": "OnFailure",
            "securityContext": pod_security(),
            "containers": [container],
            "volumes": [model_cache.volume(spec)],
        },
        spec.router.placement,
        spec,
    )
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": model_cache.job_name(spec),
            "namespace": spec.namespace,
            "labels": labels(spec.name, model_cache.VOLUME),
        },
        "spec": {"backoffLimit": 6, "template": {"spec": pod}},
    }
    return [*([claim] if claim else []), job]
