"""Worker revisions: which engine a pod runs, and when an old revision may go.

A revision is a short hash of everything that changes what an engine computes (image,
model, engine flags, the KV transport, the Ray version) and of the rendered head and worker
pod templates (sizes left out), so every pod-level setting (resources, cpusPerWorker, UCX and
RDMA env, hostNetwork, pull secrets, scheduling, and any setting podparts.py adds later) is a
new revision: KubeRay never recreates a running pod when its template changes, so a setting
outside the hash would never reach running pods. Workers report it, and a router pairs
prefill and decode workers of one revision only, so a change never mixes P and D that
disagree on the KV layout or the model.

Each revision gets its own RayCluster (`<service>-<rev[:8]>`); how the service moves to it
(Rolling or BlueGreen) is upgrade.py's and rolling.py's.
KubeRay's RayCluster has no upgrade strategy (only RayService has), and one Ray cluster
cannot mix Ray or kvrelay versions in its head, so an in-place roll is not an option. The
router Deployment rolls to the new cluster (a new pod template: new Ray address, new
KVRELAY_GENERATION); its readiness (/health needs a worker) holds the old routers until new
ones serve; an old RayCluster is deleted once no router pod of its revision remains,
terminating ones included (they may still stream). Pure: no I/O.

The names outside the code keep the older word: $KVRELAY_GENERATION, the label
`kvrelay.io/generation` and the status field `generation` (running deployments and their
users read them); `metadata.generation` / `observedGeneration` are Kubernetes' own, another
thing (a spec's edit count).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvrelay_operator.names import REVISION_LABEL
from kvrelay_operator.ray_access import RAY_AUTH_MODE
from kvrelay_operator.raycluster import desired_raycluster
from kvrelay_operator.spec import ServiceSpec

REVISION_LENGTH = 12
# Rendered in place of the revision (its labels and $KVRELAY_GENERATION) while hashing.
PLACEHOLDER = "revision"
# A worker group's sizing: a resize is no new revision (drain.py shrinks in place).
SIZING_FIELDS = ("replicas", "minReplicas", "maxReplicas", "scaleStrategy")


def rendered_groups(spec: ServiceSpec) -> dict[str, Any]:
    """The head group and each worker group as the RayCluster carries them (pod templates,
    Ray start parameters), sizes left out: what the revision hash covers besides the named
    inputs, so a pod setting added to podparts.py later is covered without a change here."""
    cluster = desired_raycluster(spec, PLACEHOLDER, {"prefill": 0, "decode": 0})["spec"]
    workers = {
        str(group["groupName"]): {k: v for k, v in group.items() if k not in SIZING_FIELDS}
        for group in cluster["workerGroupSpecs"]
    }
    return {"head": cluster["headGroupSpec"], "workers": workers}


def revision_inputs(spec: ServiceSpec) -> dict[str, Any]:
    """What names a revision: every field that changes an engine's behaviour, and the
    rendered pods."""
    model = spec.model
    return {
        "image": spec.image,
        "model": [
            model.source,
            model.pvc_claim,
            model.pvc_path,
            model.folder,
            model.image_ref,
            model.image_path,
            model.hub_id,
            model.hub_revision,
        ],
        "engineArgs": list(spec.engine_args),
        "prefillArgs": list(spec.prefill.engine_args),
        "decodeArgs": list(spec.decode.engine_args),
        "kvBackend": spec.kv.backend,
        "ray": spec.ray_version,
        # A Ray cluster cannot mix nodes with and without token authentication (each refuses
        # or omits the other's token): turning it on (ray_access.py) is a new revision, so
        # running services move to a new cluster blue/green instead of breaking in place.
        "rayAuth": RAY_AUTH_MODE,
        # Everything a worker pod is made of; the operator's own version is not an input:
        # an operator upgrade that renders the same pods rolls no service (upgrade.py).
        "pods": rendered_groups(spec),
    }


def revision_hash(spec: ServiceSpec) -> str:
    """12 hex characters naming the spec's worker revision."""
    canonical = json.dumps(revision_inputs(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]


def revision_of(obj: Mapping[str, Any]) -> str:
    """An object's revision label; "" for one made before revisions (or not ours)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return str(labels.get(REVISION_LABEL, ""))


def clusters_to_retire(
    clusters: Iterable[Mapping[str, Any]],
    router_pods: Iterable[Mapping[str, Any]],
    current: str,
    keep: Iterable[str] = (),
) -> list[str]:
    """Names of the service's RayClusters of older revisions that no router pod uses.

    Args:
        clusters: the service's RayClusters (any revision).
        router_pods: the service's router pods, terminating ones included.
        current: the spec's revision; its cluster is never retired.
        keep: other revisions never retired now (a Rolling upgrade's serving one).
    """
    in_use = {revision_of(pod) for pod in router_pods} | set(keep)
    out = []
    for cluster in clusters:
        rev = revision_of(cluster)
        if rev != current and rev not in in_use:
            out.append(str(cluster["metadata"]["name"]))
    return sorted(out)
