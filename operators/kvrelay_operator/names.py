"""API coordinates, child object names and labels: every name the operator gives out.

Kept in one place so the reconciler, the status reader and the planner always agree on
which object is whose.
"""

from __future__ import annotations

GROUP = "kvrelay.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SERVICE_KIND = "KVRelayService"
SERVICE_PLURAL = "kvrelayservices"
POOL_KIND = "KVRelayPool"
POOL_PLURAL = "kvrelaypools"

# One field manager for every server-side apply, so ownership of fields is stable.
FIELD_MANAGER = "kvrelay-operator"

POOLS = ("prefill", "decode")
HTTP_PORT = 8000
GRPC_PORT = 50051
RAY_CLIENT_PORT = 10001
RAY_GCS_PORT = 6379
CACHE_DIR = "/var/cache/kvrelay"
# The Hugging Face cache of a `source: hub` model, on the cache volume (HF_HUB_CACHE).
HUB_CACHE_DIR = f"{CACHE_DIR}/huggingface/hub"
MODEL_MOUNT = "/models"

KV_SECRET_MOUNT = "/var/run/secrets/kvrelay/kv"
KV_SECRET_KEY = "secret"

# KubeRay's own pod labels: a worker group's pods carry both.
RAY_CLUSTER_LABEL = "ray.io/cluster"
RAY_GROUP_LABEL = "ray.io/group"
# The worker revision of a RayCluster, its pods and the router pods that use it. The label's
# key keeps its old word, "generation": running deployments' objects carry it.
REVISION_LABEL = f"{GROUP}/generation"


def raycluster_name(service: str, revision: str) -> str:
    """One RayCluster per revision (blue/green): `<service>-<first 8 hex of revision>`."""
    return f"{service}-{revision[:8]}"


def ray_head_service(service: str, revision: str) -> str:
    """The head Service KubeRay creates for a RayCluster."""
    return f"{raycluster_name(service, revision)}-head-svc"


def kv_secret_name(service: str) -> str:
    """The KV transfer Secret the operator creates when the service names none."""
    return f"{service}-kv"


def router_name(service: str) -> str:
    return f"{service}-router"


def pool_name(service: str, pool: str) -> str:
    return f"{service}-{pool}"


def pdb_name(service: str, component: str) -> str:
    return f"{service}-{component}"


def pool_selector(service: str, pool: str, revision: str) -> str:
    """The label selector of a pool's worker pods in the serving revision, as the scale
    subresource reports it."""
    return f"{RAY_CLUSTER_LABEL}={raycluster_name(service, revision)},{RAY_GROUP_LABEL}={pool}"


def component_selector(service: str, component: str) -> str:
    """A selector string over `selector_labels`: every revision's pods of a component."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(service, component).items())


def labels(service: str, component: str) -> dict[str, str]:
    """Recommended app.kubernetes.io labels of every child of `service`."""
    return {
        "app.kubernetes.io/name": "kvrelay",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvrelay",
        "app.kubernetes.io/managed-by": "kvrelay-operator",
    }


def selector_labels(service: str, component: str) -> dict[str, str]:
    """The immutable subset of `labels` that Deployments and Services select on."""
    return {
        "app.kubernetes.io/name": "kvrelay",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/component": component,
    }
