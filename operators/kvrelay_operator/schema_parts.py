"""Schema builders for Kubernetes' own types as CRD fields (quantities, resources,
tolerations, conditions), spelled the way the core API's OpenAPI spells them.

Pure data; `crds.py` composes kvrelay's CRDs from these.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

# Kubernetes' resource.Quantity grammar, as its own OpenAPI schema spells it.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
_QUANTITY = rf"^(\+|-)?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"


def string(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def int32(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def quantity_map(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": _QUANTITY,
        },
    }


def resources() -> Schema:
    return {
        "type": "object",
        "description": "Compute resources of each container (Kubernetes ResourceRequirements).",
        "properties": {
            "limits": quantity_map("Most a container may use, e.g. cpu: 4, memory: 16Gi."),
            "requests": quantity_map("What the scheduler reserves for a container."),
        },
    }


def node_selector() -> Schema:
    return {
        "type": "object",
        "description": "Labels a node must have for these pods to run on it.",
        "additionalProperties": {"type": "string"},
    }


def tolerations() -> Schema:
    return {
        "type": "array",
        "description": "Taints these pods tolerate (Kubernetes Toleration).",
        "items": {
            "type": "object",
            "properties": {
                "key": string("Taint key; empty with operator Exists matches every taint."),
                "operator": string("How key and value match.", enum=["Exists", "Equal"]),
                "value": string("Taint value for operator Equal."),
                "effect": string(
                    "Taint effect; empty matches all.",
                    enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"],
                ),
                "tolerationSeconds": {
                    "type": "integer",
                    "format": "int64",
                    "description": "How long a NoExecute taint is tolerated.",
                },
            },
        },
    }


# Kubernetes object names a pod refers to (PriorityClass, RuntimeClass, Secret): DNS-1123
# subdomains.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def object_name(description: str) -> Schema:
    return string(description, pattern=DNS_SUBDOMAIN, maxLength=253)


def passthrough(description: str, type_: str = "object") -> Schema:
    """A core type kept whole (Affinity, TopologySpreadConstraint): the API server checks it
    when it reaches a pod, so the CRD does not restate Kubernetes' own schema."""
    schema: Schema = {
        "type": type_,
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }
    return schema


def pull_secrets() -> Schema:
    return {
        "type": "array",
        "description": "Secrets to pull the image with (LocalObjectReference).",
        "maxItems": 16,
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": object_name("Secret name.")},
        },
    }


def spread_constraints() -> Schema:
    return {
        "type": "array",
        "description": "How these pods spread over zones or nodes (Kubernetes "
        "TopologySpreadConstraint); labelSelector usually selects this pool's pods.",
        "maxItems": 8,
        "items": {
            **passthrough("A TopologySpreadConstraint."),
            "required": ["maxSkew", "topologyKey", "whenUnsatisfiable"],
        },
    }


def placement() -> dict[str, Schema]:
    """Where and how a group of pods runs: the fields a production pod spec needs."""
    return {
        "resources": resources(),
        "nodeSelector": node_selector(),
        "tolerations": tolerations(),
        "affinity": passthrough("Node and pod (anti-)affinity (Kubernetes Affinity)."),
        "topologySpreadConstraints": spread_constraints(),
        "priorityClassName": object_name("PriorityClass of these pods."),
        "runtimeClassName": object_name(
            "RuntimeClass of these pods (e.g. nvidia where the GPU runtime is not the default)."
        ),
        "imagePullSecrets": pull_secrets(),
    }


def conditions() -> Schema:
    return {
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status", "lastTransitionTime"],
            "properties": {
                "type": string("Ready, PrefillReady, DecodeReady or RouterReady."),
                "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
                "reason": string("CamelCase reason."),
                "message": string("What a person should know."),
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            },
        },
    }


def replica_status() -> Schema:
    return {
        "type": "object",
        "properties": {"replicas": int32("Desired."), "readyReplicas": int32("Ready.")},
    }


def resource_schema(
    spec: Schema, status: Schema, validations: list[Schema] | None = None
) -> Schema:
    """A custom resource's top level: the standard fields, then its spec and status."""
    schema: Schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if validations:
        schema["x-kubernetes-validations"] = validations
    return schema
