"""The `KVRELAY_*` environment variables of the operator, named once: those it sets on the pods
it makes (kvrelay reads them: `kvrelay.common.env` declares each, and tests/test_env_registry.py
checks the two packages agree on every name) and the two it reads itself.

The operator imports neither kvrelay nor torch, so it keeps the shared names as constants
here; docs/operations.md lists them all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Set on kvrelay's pods, read by kvrelay.
API_KEY_ENV = "KVRELAY_API_KEY"  # the router's API key (from the service's apiKeySecret)
CACHE_DIR_ENV = "KVRELAY_CACHE_DIR"  # where the default model is kept (names.CACHE_DIR)
ENGINE_ARGS_ENV = "KVRELAY_ENGINE_ARGS"  # a pool's engine flags, read by its engine actors
GENERATION_ENV = "KVRELAY_GENERATION"  # the revision's hash (the name keeps the older word)
KV_SECRET_FILE_ENV = "KVRELAY_KV_SECRET_FILE"  # the mounted KV secret (kvrelay.transfer.kv_secret)
KV_HOST_ENV = "KVRELAY_KV_HOST"  # the pod's IP, where its KV servers bind
POD_NAME_ENV = "KVRELAY_POD_NAME"  # the pod's name: the worker's
NODE_NAME_ENV = "KVRELAY_NODE_NAME"  # the node's name, in the worker's description
SHARED = (
    API_KEY_ENV,
    CACHE_DIR_ENV,
    ENGINE_ARGS_ENV,
    GENERATION_ENV,
    KV_SECRET_FILE_ENV,
    KV_HOST_ENV,
    POD_NAME_ENV,
    NODE_NAME_ENV,
)

# Set on kvrelay's pods for people reading a pod's environment; no code reads them.
COMPONENT_ENV = "KVRELAY_COMPONENT"  # router, or the pool's name
SERVICE_ENV = "KVRELAY_SERVICE"  # the KVRelayService's name
LABELS = (COMPONENT_ENV, SERVICE_ENV)


@dataclass(frozen=True)
class EnvVar:
    """One variable the operator reads: `get` reads it (at call time); the rest documents it."""

    name: str
    type: str
    default: str  # what `get` returns when the variable is unset
    meaning: str
    unset: str = ""  # what an unset variable means, where `default` alone does not say

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        """The value in `environ` (None: `os.environ`, read now), else `default`."""
        return (os.environ if environ is None else environ).get(self.name, self.default)

    def shown_default(self) -> str:
        """The default as docs/operations.md states it."""
        return self.unset or (f"`{self.default}`" if self.default else "unset")


IMAGE = EnvVar(
    "KVRELAY_IMAGE",
    "image reference",
    "",
    "the operator's `--image`: image of the pods of services that name none (the chart sets it)",
    unset="empty",
)
PEERING = EnvVar(
    "KVRELAY_PEERING",
    "name",
    "kvrelay",
    "the operator's `--peering`: the kopf peering object its replicas share (the chart creates it)",
)

PULL_SECRETS = EnvVar(
    "KVRELAY_IMAGE_PULL_SECRETS",
    "comma-separated names",
    "",
    "the operator's `--image-pull-secret`s: Secrets every pod of every service pulls with, "
    "besides the service's own (the chart passes its `imagePullSecrets`)",
    unset="none",
)

REGISTRY: tuple[EnvVar, ...] = (IMAGE, PEERING, PULL_SECRETS)
