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


def placement() -> dict[str, Schema]:
    return {
        "resources": resources(),
        "nodeSelector": node_selector(),
        "tolerations": tolerations(),
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
