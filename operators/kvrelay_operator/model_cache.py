"""The default model cached once per service: a PersistentVolumeClaim filled by one Job,
which every router and worker pod mounts read-only and waits for.

Without it each pod's init container downloads and converts the model into its own cache
(`podparts.init_containers`). With `model.cache.shared` the operator makes `<name>-model-
cache` (or uses `claimName`: a claim filled beforehand serves an air-gapped cluster, since
the pull is a no-op once the model is there) and a Job `<name>-model-cache-<hash>` that runs
`kvrelay model pull-default` into it and then writes READY_MARKER; pods wait for the marker
in an init container and never convert. Pure builders; nothing here talks to Kubernetes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrelay_operator.errors import SpecError
from kvrelay_operator.names import CACHE_DIR, labels

if TYPE_CHECKING:
    from kvrelay_operator.spec import ServiceSpec

Obj = dict[str, Any]

# kvrelay keeps the default model at $KVRELAY_CACHE_DIR/models/<name> (kvrelay.models.
# default_model); the claim is mounted there, so the rest of the cache stays per pod.
MODELS_DIR = f"{CACHE_DIR}/models"
READY_MARKER = f"{MODELS_DIR}/.kvrelay-default-ready"
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")
VOLUME = "model-cache"
WAIT_SECONDS = 5


@dataclass(frozen=True)
class ModelCache:
    """`spec.model.cache`: whether the default model is shared, and its claim."""

    shared: bool = False
    claim_name: str = ""  # an existing claim; empty: the operator creates one
    size: str = "4Gi"
    storage_class: str = ""
    access_mode: str = "ReadWriteMany"

    @staticmethod
    def parse(raw: Mapping[str, Any], source: str) -> ModelCache:
        cache = ModelCache(
            shared=bool(raw.get("shared", False)),
            claim_name=str(raw.get("claimName", "")),
            size=str(raw.get("size", "4Gi")),
            storage_class=str(raw.get("storageClassName", "")),
            access_mode=str(raw.get("accessMode", "ReadWriteMany")),
        )
        if cache.access_mode not in ACCESS_MODES:
            raise SpecError(
                f"model.cache.accessMode {cache.access_mode!r} is not one of "
                f"{', '.join(ACCESS_MODES)}"
            )
        if (cache.shared or raw.get("claimName")) and source != "default":
            raise SpecError(
                f"model.cache is for source default, not {source}: a pvc or image model is "
                "already shared, and a hub model is pulled by each pod's init container"
            )
        if cache.claim_name and not cache.shared:
            raise SpecError("model.cache.claimName needs model.cache.shared: true")
        return cache


def enabled(spec: ServiceSpec) -> bool:
    return spec.model.source == "default" and spec.model.cache.shared


def claim_name(spec: ServiceSpec) -> str:
    return spec.model.cache.claim_name or f"{spec.name}-model-cache"


def job_name(spec: ServiceSpec) -> str:
    """One Job per image and claim: a Job's pod template is immutable, so a new image makes
    a new Job (a no-op pull where the model is already there)."""
    key = f"{spec.image}\n{claim_name(spec)}".encode()
    return f"{spec.name}-model-cache-{hashlib.sha256(key).hexdigest()[:8]}"


def volume(spec: ServiceSpec) -> Obj:
    return {"name": VOLUME, "persistentVolumeClaim": {"claimName": claim_name(spec)}}


def mount(read_only: bool = True) -> Obj:
    return {"name": VOLUME, "mountPath": MODELS_DIR, "readOnly": read_only}


def desired_claim(spec: ServiceSpec) -> Obj | None:
    """The claim the operator creates; None when the service names its own."""
    cache = spec.model.cache
    if cache.claim_name:
        return None
    claim: Obj = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size}},
        "volumeMode": "Filesystem",
    }
    if cache.storage_class:
        claim["storageClassName"] = cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": claim_name(spec),
            "namespace": spec.namespace,
            "labels": labels(spec.name, VOLUME),
        },
        "spec": claim,
    }


def wait_container(spec: ServiceSpec, security: Obj, resources: Obj) -> Obj:
    """The init container that holds a pod until the Job has filled the cache."""
    script = (
        f"until [ -f {READY_MARKER} ]; do echo 'waiting for the model cache Job "
        f"{job_name(spec)} to fill {claim_name(spec)}'; sleep {WAIT_SECONDS}; done"
    )
    return {
        "name": "wait-model-cache",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["/bin/sh", "-c", script],
        "volumeMounts": [mount()],
        "resources": resources,
        "securityContext": security,
    }


def fill_command() -> list[str]:
    """Pull (a no-op when a pre-filled claim has the model), then mark the cache ready."""
    return ["/bin/sh", "-c", f"kvrelay model pull-default && touch {READY_MARKER}"]
