"""The routers' API key: the Secret named in `spec.router.apiKeySecret`, or, when the service
names none, `<service>-api-key` (key `api-key`, 256 random bits) that the operator creates once.

Routers listen on 0.0.0.0 in their pods, and nothing kvrelay listens on serves data without
authentication, so every router gets a key: there is no opt-out here (a user who wants an
open API runs a gateway in front of it). The generated Secret is never applied again nor
regenerated: clients hold the key, and a new one would lock them out. It is owned by the
service, so deleting the service deletes it. Users read it with
`kubectl get secret <service>-api-key -o jsonpath='{.data.api-key}' | base64 -d`.
"""

from __future__ import annotations

import logging
import secrets

from kvrelay_operator.errors import PermanentError
from kvrelay_operator.kube import Kube
from kvrelay_operator.podparts import Obj
from kvrelay_operator.spec import ServiceSpec

log = logging.getLogger(__name__)

API_KEY_SECRET_KEY = "api-key"  # the data key, the same default as apiKeySecret.key


def api_key_secret_name(service: str) -> str:
    """The Secret the operator creates when the service names none of its own."""
    return f"{service}-api-key"


def api_key_ref(spec: ServiceSpec) -> tuple[str, str]:
    """(Secret name, data key) the routers read their key from: the service's own, else
    the generated one."""
    if spec.router.api_key_secret:
        return spec.router.api_key_secret, spec.router.api_key_key
    return api_key_secret_name(spec.name), API_KEY_SECRET_KEY


def new_api_key() -> str:
    """256 random bits, URL-safe: fits an `Authorization: Bearer` header as it is."""
    return secrets.token_urlsafe(32)


def desired_api_key_secret(spec: ServiceSpec, key: str) -> Obj:
    """The generated API key's Secret (owned by the service), created once."""
    from kvrelay_operator.desired import generated_secret  # desired imports us (via the router)

    name = api_key_secret_name(spec.name)
    return generated_secret(spec, name, "router", API_KEY_SECRET_KEY, key.encode())


def ensure_api_key_secret(kube: Kube, spec: ServiceSpec) -> None:
    """Create `<service>-api-key` unless the service names its own Secret or it exists.

    Without the rights to read Secrets (chart value rbac.secrets off) a warning says what
    to create; the router pods ask for it all the same, so they do not start without it
    (closed, never open)."""
    if spec.router.api_key_secret:
        return
    name = api_key_secret_name(spec.name)
    try:
        if kube.get("v1", "Secret", spec.namespace, name) is None:
            kube.create(desired_api_key_secret(spec, new_api_key()))
    except PermanentError as exc:
        if exc.status != 403:
            raise
        log.warning(
            "%s/%s: no rights to read or create Secrets: the routers need Secret %s (key %s) "
            "holding their API key and will not start without it; create it, name your own "
            "in spec.router.apiKeySecret, or let the operator manage Secrets (chart value "
            "rbac.secrets)",
            spec.namespace,
            spec.name,
            name,
            API_KEY_SECRET_KEY,
        )
