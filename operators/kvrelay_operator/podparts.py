"""Pieces every kvrelay pod shares: the model and cache volumes, env, security, placement.

Pure builders over a `ServiceSpec`; the router and the Ray worker groups assemble their pod
templates from these so that every pod sees the model at the same path.
"""

from __future__ import annotations

from typing import Any

from kvrelay_operator.names import CACHE_DIR, MODEL_MOUNT
from kvrelay_operator.spec import Placement, ServiceSpec

Obj = dict[str, Any]

# The image's unprivileged user (see the Dockerfile); fsGroup lets it write the cache volume.
RUN_AS_USER = 1000


def model_arg(spec: ServiceSpec) -> str:
    """The `--model` value every kvrelay process gets."""
    if spec.model.source == "pvc":
        return f"{MODEL_MOUNT}/{spec.model.pvc_path}".rstrip("/")
    if spec.model.source == "folder":
        return spec.model.folder
    return "default"


def volumes(spec: ServiceSpec) -> list[Obj]:
    cache: Obj = (
        {"name": "cache", "persistentVolumeClaim": {"claimName": spec.model.cache_claim}}
        if spec.model.cache_claim
        else {"name": "cache", "emptyDir": {}}
    )
    out = [cache]
    if spec.model.source == "pvc":
        out.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": spec.model.pvc_claim, "readOnly": True},
            }
        )
    return out


def volume_mounts(spec: ServiceSpec) -> list[Obj]:
    out: list[Obj] = [{"name": "cache", "mountPath": CACHE_DIR}]
    if spec.model.source == "pvc":
        out.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return out


def base_env(spec: ServiceSpec, component: str) -> list[Obj]:
    return [
        {"name": "KVRELAY_CACHE_DIR", "value": CACHE_DIR},
        {"name": "KVRELAY_COMPONENT", "value": component},
        {"name": "KVRELAY_SERVICE", "value": spec.name},
        # Ray and torch size their thread pools from the node; keep them to the pod's share.
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]


def container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER}


def init_containers(spec: ServiceSpec, resources: Obj) -> list[Obj]:
    """Fetch the default model into the cache before the engine starts (a no-op once cached)."""
    if spec.model.source != "default":
        return []
    return [
        {
            "name": "pull-model",
            "image": spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": ["kvrelay", "model", "pull-default"],
            "env": [{"name": "KVRELAY_CACHE_DIR", "value": CACHE_DIR}],
            "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}],
            "resources": resources,
            "securityContext": container_security(),
        }
    ]


def place(pod_spec: Obj, placement: Placement) -> Obj:
    """Add node selector and tolerations to a pod spec (only when set, to keep diffs small)."""
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in placement.tolerations]
    return pod_spec


def resources(placement: Placement) -> Obj:
    return {k: dict(v) for k, v in placement.resources.items() if v}
