"""Who may talk to a service's Ray cluster: Ray's token authentication, its token in a Secret
the operator creates once, and a NetworkPolicy that lets only the service's own pods reach
the Ray pods.

Ray's GCS, raylets, workers and agents listen on the pod IP (they must: the nodes of one
cluster dial each other), and whoever reaches them can run code in the cluster. Ray >= 2.52
asks every caller for the cluster's token when RAY_AUTH_MODE=token (dashboard health checks,
which KubeRay's probes call, excepted); the NetworkPolicy keeps everyone else from reaching the
ports at all. The router, a Ray client of the head, needs the token but listens on no Ray port.

The builders here are pure; `ensure_ray_auth_secret` is the one API call (a Secret's token
must never change under running pods, so it is created once, never applied).
"""

from __future__ import annotations

import logging
import re
import secrets

from kvrelay_operator.errors import PermanentError
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import POOLS, labels
from kvrelay_operator.podparts import Obj
from kvrelay_operator.spec import ServiceSpec

log = logging.getLogger(__name__)

RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_MODE = "token"  # every revision's; part of the revision hash (revision.py)
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
# The key KubeRay's own `authOptions.secretName` reads too, so one Secret serves either.
RAY_AUTH_SECRET_KEY = "auth_token"
TOKEN_AUTH_SINCE = (2, 52)
RAY_HEAD_COMPONENT = "ray-head"
RAY_COMPONENTS = (RAY_HEAD_COMPONENT, *POOLS)


def ray_auth_secret_name(service: str) -> str:
    """The Secret holding a service's Ray token (key `auth_token`)."""
    return f"{service}-ray-auth"


def ray_network_policy_name(service: str) -> str:
    return f"{service}-ray"


def ray_auth_env(spec: ServiceSpec) -> list[Obj]:
    """The env of every Ray process of the service (head, workers, the router's client):
    token mode, and the token from the service's Secret. A missing Secret stops the pod at
    start with an error naming it; Ray never starts without the token."""
    require_token_auth(spec.ray_version)
    secret = {"name": ray_auth_secret_name(spec.name), "key": RAY_AUTH_SECRET_KEY}
    return [
        {"name": RAY_AUTH_MODE_ENV, "value": RAY_AUTH_MODE},
        {"name": RAY_AUTH_TOKEN_ENV, "valueFrom": {"secretKeyRef": secret}},
    ]


def require_token_auth(ray_version: str) -> None:
    """Refuse a Ray release without token authentication, which would ignore RAY_AUTH_MODE
    and answer anyone. A version that is not numbered (`nightly`) is taken as recent.

    Raises:
        PermanentError: `ray_version` is below 2.52.
    """
    match = re.match(r"\s*(\d+)\.(\d+)", ray_version)
    if match and (int(match[1]), int(match[2])) < TOKEN_AUTH_SINCE:
        raise PermanentError(
            f"spec.ray.rayVersion {ray_version}: Ray before 2.52 has no token authentication, "
            "so its cluster would run code for anyone who reaches it; use an image with Ray "
            ">= 2.52 (kvrelay's has 2.60.0)"
        )


def desired_ray_auth_secret(spec: ServiceSpec, token: str) -> Obj:
    """The Ray token Secret the operator creates once per service (owned by it)."""
    from kvrelay_operator.desired import generated_secret  # desired imports this module

    name = ray_auth_secret_name(spec.name)
    return generated_secret(spec, name, "ray", RAY_AUTH_SECRET_KEY, token.encode())


def ensure_ray_auth_secret(kube: Kube, spec: ServiceSpec) -> None:
    """Create the service's Ray token Secret unless it exists (256 random bits, hex, as
    `ray get-auth-token --generate` makes them).

    Without the rights to read Secrets (chart value rbac.secrets off) someone else must
    have created it: a warning says so, and pods without it do not start."""
    name = ray_auth_secret_name(spec.name)
    try:
        if kube.get("v1", "Secret", spec.namespace, name) is None:
            kube.create(desired_ray_auth_secret(spec, secrets.token_hex(32)))
    except PermanentError as exc:
        if exc.status != 403:
            raise
        log.warning(
            "%s/%s: no rights to read or create Secrets: the Ray pods need Secret %s (key %s) "
            "and will not start without it; create it, or let the operator manage Secrets "
            "(chart value rbac.secrets)",
            spec.namespace,
            spec.name,
            name,
            RAY_AUTH_SECRET_KEY,
        )


def desired_ray_network_policy(spec: ServiceSpec) -> Obj:
    """Ingress to the service's Ray pods (head and every worker group, every revision) from
    its own pods only: the router, the head, the workers. Other pods, other namespaces and
    anything outside the cluster are refused on every port. Pods on the host network (RDMA
    without a CNI) are outside any NetworkPolicy; docs/operations.md says what covers them."""
    own = {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/instance": spec.name}
    ray_pods = {
        "matchLabels": own,
        "matchExpressions": [
            {
                "key": "app.kubernetes.io/component",
                "operator": "In",
                "values": list(RAY_COMPONENTS),
            }
        ],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": ray_network_policy_name(spec.name),
            "namespace": spec.namespace,
            "labels": labels(spec.name, "ray"),
        },
        "spec": {
            "podSelector": ray_pods,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": own}}]}],
        },
    }
