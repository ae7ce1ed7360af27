"""Validation helpers shared by the chart and operator tests.

Built-in kinds are checked strictly with kubernetes-validate for every supported Kubernetes
version; our custom resources against the chart's CRD schemas (jsonschema, after the API
server's structural defaulting); KubeRay's RayCluster and prometheus-operator's
ServiceMonitor, whose CRDs are not available offline, through their pod templates
(strictly, as PodTemplates) and a schema of the fields we set.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvrelay"
# test_crds checks the files under crds/ are
# what the generator in kvrelay_operator.crds writes.
CRD_DIR = CHART / "crds"
KUBE_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33")

Obj = dict[str, Any]


@cache
def crds() -> dict[str, Obj]:
    """Kind -> CRD object, from the generator the chart's templates are written by."""
    from kvrelay_operator.crds import CRD_FILES

    out = {}
    for build in CRD_FILES.values():
        crd = build()
        out[crd["spec"]["names"]["kind"]] = crd
    return out


def crd_schema(kind: str) -> Obj:
    return crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: Obj, value: Any) -> Any:
    """Structural defaulting as the API server does it: a missing property with a default
    gets it, then defaults inside it apply too."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden, as `fieldValidation=Strict` (kubectl's
    default) rejects them where the API server would otherwise prune them silently."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: strict(v) if k in ("properties", "items", "additionalProperties") else v
        for k, v in schema.items()
    }
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


@cache
def _custom_validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(crd_schema(kind)))


def validate_custom(obj: Obj) -> Obj:
    """Default and validate one of our custom resources; returns the defaulted object.

    Raises:
        jsonschema.ValidationError: the object does not fit its CRD.
    """
    defaulted = apply_defaults(crd_schema(obj["kind"]), obj)
    _custom_validator(obj["kind"]).validate(defaulted)
    return defaulted


_SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}

# The RayCluster fields we set (ray.io/v1), as KubeRay's CRD types them; any other field
# is refused, so a misspelt one cannot pass.
_RAY_GROUP_FIELDS = {
    "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
    "template": {"type": "object"},
}
_RAYCLUSTER = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["headGroupSpec", "workerGroupSpecs"],
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "headGroupSpec": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["rayStartParams", "template"],
                    "properties": {**_RAY_GROUP_FIELDS, "serviceType": {"type": "string"}},
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": [
                            "groupName",
                            "replicas",
                            "minReplicas",
                            "maxReplicas",
                            "rayStartParams",
                            "template",
                        ],
                        "properties": {
                            **_RAY_GROUP_FIELDS,
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 0},
                            "scaleStrategy": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "workersToDelete": {
                                        "type": "array",
                                        "items": {"type": "string"},
                                    }
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def _validate_raycluster(obj: Obj, version: str) -> None:
    jsonschema.Draft7Validator(_RAYCLUSTER).validate(obj)
    groups = [obj["spec"]["headGroupSpec"], *obj["spec"]["workerGroupSpecs"]]
    for group in groups:
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": group["template"],
        }
        kubernetes_validate.validate(template, version, strict=True)
    for group in obj["spec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group


def validate_object(obj: Obj, version: str) -> None:
    """Validate any object the chart or the operator produces, for one Kubernetes version.

    Raises:
        jsonschema.ValidationError (kubernetes_validate.ValidationError is one): invalid.
    """
    kind = obj["kind"]
    if obj["apiVersion"].startswith(("kvrelay.io/", "kopf.dev/")):
        validate_custom(obj)
    elif kind == "RayCluster":
        _validate_raycluster(obj, version)
    elif kind == "ServiceMonitor":
        jsonschema.Draft7Validator(_SERVICE_MONITOR).validate(obj)
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
            version,
            strict=True,
        )
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def validate_everywhere(obj: Obj) -> None:
    for version in KUBE_VERSIONS:
        validate_object(obj, version)
