"""The KVRelayService and KVRelayPool CustomResourceDefinitions, built as data.

This is the one source of the CRDs: the chart's `crds/*.yaml` are written from it
(`python -m kvrelay_operator.crds deploy/helm/kvrelay/crds`) and a test checks they are current.
The operator itself never reads these at run time; the API server applies the defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvrelay_operator.names import GROUP, POOL_KIND, POOL_PLURAL, SERVICE_KIND, SERVICE_PLURAL
from kvrelay_operator.names import VERSION as API_VERSION
from kvrelay_operator.schema_parts import (
    Schema,
    conditions,
    int32,
    placement,
    replica_status,
    string,
)

# Names feed child names such as `<name>-head-svc` and `<name>-prefill-pdb`, which must stay
# DNS labels (63 characters); 40 leaves room for every suffix.
MAX_NAME_LENGTH = 40


def _autoscaling_rules() -> list[Schema]:
    """CEL rules across the autoscaling fields (a fresh list: YAML must not alias it)."""
    return [
        {
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "minReplicas must not exceed maxReplicas",
        },
        {
            "rule": "self.metric != 'kvUsage' || !self.target.endsWith('s')",
            "message": "kvUsage takes a ratio such as 0.8, not a duration",
        },
        {
            "rule": "self.metric == 'kvUsage' || self.target.endsWith('s')",
            "message": "ttft and itl take a duration such as 500ms",
        },
    ]


def _autoscaling(pool: str) -> Schema:
    """Planner bounds and SLO target of one pool; prefill targets TTFT, decode ITL or KV use."""
    metrics = ["ttft"] if pool == "prefill" else ["itl", "kvUsage"]
    default_metric = metrics[0]
    default_target = "500ms" if pool == "prefill" else "100ms"
    return {
        "type": "object",
        "description": f"The planner sets the {pool} pool's replicas within bounds toward a "
        "target. Leave disabled when an HPA or KEDA scales the KVRelayPool instead.",
        "default": {},
        "properties": {
            "enabled": {"type": "boolean", "default": False, "description": "Run the planner."},
            "minReplicas": int32("Fewest workers.", minimum=1, default=1),
            "maxReplicas": int32("Most workers.", minimum=1, maximum=1000, default=4),
            "metric": string(
                "The SLO signal: ttft (p-th percentile time to first token), itl (p-th "
                "percentile inter-token latency), kvUsage (mean KV cache use, 0..1).",
                enum=metrics,
                default=default_metric,
            ),
            "target": string(
                "Target value: a duration such as 500ms or 1.5s for ttft / itl, a ratio "
                "such as 0.8 for kvUsage.",
                pattern=r"^([0-9]+(\.[0-9]+)?(ms|s)|0(\.[0-9]+)?|1(\.0+)?)$",
                default=default_target,
            ),
            "percentile": int32(
                "Percentile of the latency signal.", minimum=50, maximum=99, default=90
            ),
            "tolerance": {
                "type": "number",
                "description": "Hysteresis: no change while the signal is within this "
                "fraction of the target.",
                "minimum": 0,
                "maximum": 0.9,
                "default": 0.1,
            },
            "scaleUpCooldownSeconds": int32(
                "Least time between two scale-ups.", minimum=0, maximum=3600, default=60
            ),
            "scaleDownCooldownSeconds": int32(
                "Least time after any change before a scale-down.",
                minimum=0,
                maximum=86400,
                default=300,
            ),
        },
        "x-kubernetes-validations": _autoscaling_rules(),
    }


def _engine_args(description: str) -> Schema:
    return {
        "type": "array",
        "description": description,
        "maxItems": 64,
        "items": {"type": "string", "pattern": r"^--[a-z0-9][a-z0-9-]*(=.*)?$"},
    }


def _pool(pool: str, default_replicas: int) -> Schema:
    return {
        "type": "object",
        "description": f"The {pool} worker pool: a KubeRay worker group, one engine per pod.",
        "default": {},
        "properties": {
            "replicas": int32(
                "Workers when the pool is first created; afterwards scale the KVRelayPool "
                "(kubectl scale, HPA, KEDA or the planner).",
                minimum=0,
                maximum=1000,
                default=default_replicas,
            ),
            "cpusPerWorker": int32("Ray num-cpus of each worker.", minimum=1, default=2),
            "engineArgs": _engine_args(
                "Engine flags for this pool's workers, e.g. --max-num-seqs=64."
            ),
            **placement(),
            "autoscaling": _autoscaling(pool),
        },
    }


def service_schema() -> Schema:
    """The openAPIV3Schema of KVRelayService (spec and status)."""
    return _resource_schema(
        _service_spec(),
        _service_status(),
        validations=[
            {
                "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                "message": f"name must be at most {MAX_NAME_LENGTH} characters",
            }
        ],
    )


def _resource_schema(
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


def _service_spec() -> Schema:
    """KVRelayService's spec."""
    return {
        "type": "object",
        "description": "A disaggregated kvrelay deployment: model, pools, router, Ray.",
        "properties": {
            "image": string("Image of every pod; empty takes the operator's default."),
            "imagePullPolicy": string(
                "Pull policy of every container.",
                enum=["Always", "IfNotPresent", "Never"],
                default="IfNotPresent",
            ),
            "model": _model_schema(),
            "engineArgs": _engine_args("Engine flags passed to the router for every worker."),
            "prefill": _pool("prefill", 1),
            "decode": _pool("decode", 1),
            "router": _router_schema(),
            "kvTransfer": {
                "type": "object",
                "default": {},
                "properties": {
                    "backend": string(
                        "How KV blocks move from prefill to decode workers.",
                        enum=["nixl", "grpc"],
                        default="nixl",
                    )
                },
            },
            "ray": _ray_schema(),
            "monitoring": _monitoring_schema(),
        },
    }


def _model_schema() -> Schema:
    """Where the model comes from: the default, a claim or a folder."""
    return {
        "type": "object",
        "description": "Where the model comes from.",
        "default": {},
        "properties": {
            "source": string(
                "default: the embedded SmolLM2-135M-Instruct, fetched into the cache; "
                "pvc: a Hugging Face folder on a PersistentVolumeClaim; folder: a Hugging Face "
                "folder already in the image.",
                enum=["default", "pvc", "folder"],
                default="default",
            ),
            "pvc": {
                "type": "object",
                "description": "A claim mounted read-only at /models in every pod.",
                "required": ["claimName"],
                "properties": {
                    "claimName": string("PersistentVolumeClaim name.", minLength=1),
                    "path": string(
                        "Folder inside the claim, relative.",
                        default="",
                        pattern=r"^([^/.][^/]*(/[^/]+)*)?$",
                    ),
                },
            },
            "folder": {
                "type": "object",
                "required": ["path"],
                "description": "A Hugging Face folder at an absolute path in the image.",
                "properties": {"path": string("Absolute folder path.", pattern=r"^/.+")},
            },
            "cacheClaimName": string(
                "A PersistentVolumeClaim for KVRELAY_CACHE_DIR, so the default model is "
                "fetched once; empty gives each pod its own emptyDir."
            ),
        },
        "x-kubernetes-validations": [
            {"rule": "self.source != 'pvc' || has(self.pvc)", "message": "source pvc needs pvc"},
            {
                "rule": "self.source != 'folder' || has(self.folder)",
                "message": "source folder needs folder",
            },
        ],
    }


def _router_schema() -> Schema:
    """The router Deployment and its Service."""
    return {
        "type": "object",
        "description": "The router: OpenAI HTTP (8000) and gRPC (50051) in front of the pools.",
        "default": {},
        "properties": {
            "replicas": int32("Router pods.", minimum=1, maximum=100, default=2),
            "serviceType": string(
                "Kubernetes Service type of the router.",
                enum=["ClusterIP", "NodePort", "LoadBalancer"],
                default="ClusterIP",
            ),
            "apiKeySecret": {
                "type": "object",
                "description": "Secret holding the API key clients send as a Bearer token; "
                "without it the API is open.",
                "required": ["name"],
                "properties": {
                    "name": string("Secret name.", minLength=1),
                    "key": string("Key in the secret.", default="api-key"),
                },
            },
            **placement(),
        },
    }


def _ray_schema() -> Schema:
    """The KubeRay RayCluster."""
    return {
        "type": "object",
        "description": "The KubeRay RayCluster that runs the pools.",
        "default": {},
        "properties": {
            "rayVersion": string("Ray version in the image.", default="2.60.0"),
            "head": {
                "type": "object",
                "description": "The head pod: the GCS only, it runs no engine.",
                "default": {},
                "properties": placement(),
            },
        },
    }


def _monitoring_schema() -> Schema:
    """Prometheus scraping of the router."""
    return {
        "type": "object",
        "default": {},
        "properties": {
            "serviceMonitor": {
                "type": "object",
                "description": "A prometheus-operator ServiceMonitor for the router.",
                "default": {},
                "properties": {
                    "enabled": {"type": "boolean", "default": False},
                    "interval": string(
                        "Scrape interval.", default="15s", pattern=r"^[0-9]+(ms|s|m)$"
                    ),
                    "labels": {
                        "type": "object",
                        "description": "Labels your Prometheus selects ServiceMonitors by.",
                        "additionalProperties": {"type": "string"},
                    },
                },
            }
        },
    }


def _service_status() -> Schema:
    planner_pool = {
        "type": "object",
        "properties": {
            "desiredReplicas": int32("What the planner last asked for."),
            "signal": {"type": "number", "description": "Observed value of the SLO metric."},
            "target": {"type": "number", "description": "Target, in seconds or a ratio."},
            "reason": string("Why it scaled or held."),
            "lastScaleTime": {"type": "string", "format": "date-time"},
        },
    }
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": conditions(),
            "prefill": replica_status(),
            "decode": replica_status(),
            "router": replica_status(),
            "endpoint": string("The router's OpenAI base URL inside the cluster."),
            "planner": {
                "type": "object",
                "properties": {"prefill": planner_pool, "decode": planner_pool},
            },
        },
    }


def pool_schema() -> Schema:
    """The openAPIV3Schema of KVRelayPool, the scalable handle of one pool."""
    spec = {
        "type": "object",
        "required": ["service", "pool"],
        "properties": {
            "service": string("The owning KVRelayService.", minLength=1),
            "pool": string("Which pool.", enum=["prefill", "decode"]),
            "replicas": int32("Workers wanted.", minimum=0, maximum=1000, default=1),
        },
        "x-kubernetes-validations": [
            {"rule": "self.pool == oldSelf.pool", "message": "pool is immutable"},
            {"rule": "self.service == oldSelf.service", "message": "service is immutable"},
        ],
    }
    status = {
        "type": "object",
        "properties": {
            "replicas": int32("Worker pods that exist."),
            "readyReplicas": int32("Worker pods that are ready."),
            "selector": string("Label selector of the pool's pods, for HPA."),
        },
    }
    return _resource_schema(spec, status)


def _crd(kind: str, plural: str, short: list[str], schema: Schema, **version: Any) -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/part-of": "kvrelay"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["kvrelay"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    **version,
                }
            ],
        },
    }


def _column(name: str, path: str, type_: str = "string", priority: int = 0) -> Schema:
    column: Schema = {"name": name, "type": type_, "jsonPath": path}
    if priority:
        column["priority"] = priority
    return column


def service_crd() -> Schema:
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return _crd(
        SERVICE_KIND,
        SERVICE_PLURAL,
        ["kvrs"],
        service_schema(),
        subresources={"status": {}},
        additionalPrinterColumns=[
            _column("Ready", ready),
            _column("Prefill", ".status.prefill.readyReplicas", "integer"),
            _column("Decode", ".status.decode.readyReplicas", "integer"),
            _column("Router", ".status.router.readyReplicas", "integer"),
            _column("Endpoint", ".status.endpoint"),
            _column("Transfer", ".spec.kvTransfer.backend", priority=1),
            _column("Reason", '.status.conditions[?(@.type=="Ready")].reason', priority=1),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def pool_crd() -> Schema:
    return _crd(
        POOL_KIND,
        POOL_PLURAL,
        ["kvrp"],
        pool_schema(),
        subresources={
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        additionalPrinterColumns=[
            _column("Service", ".spec.service"),
            _column("Pool", ".spec.pool"),
            _column("Desired", ".spec.replicas", "integer"),
            _column("Current", ".status.replicas", "integer"),
            _column("Ready", ".status.readyReplicas", "integer"),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def render_yaml(crd: Schema) -> str:
    import yaml

    header = "# Generated by `python -m kvrelay_operator.crds`; do not edit.\n"
    return header + yaml.safe_dump(crd, sort_keys=False, width=100)


CRD_FILES = {"kvrelayservices.yaml": service_crd, "kvrelaypools.yaml": pool_crd}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvrelay_operator.crds OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for filename, build in CRD_FILES.items():
        (out / filename).write_text(render_yaml(build()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
