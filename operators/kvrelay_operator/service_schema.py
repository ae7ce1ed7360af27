"""KVRelayService's openAPIV3Schema: the spec (model, pools, router, KV transfer, Ray,
monitoring) and the status, built as data. `crds.py` wraps it into the CRD.

The parser in `spec.py` reads what this schema allows; a test checks their defaults agree.
"""

from __future__ import annotations

from kvrelay_operator.schema_cache import model_cache_rule, model_cache_schema
from kvrelay_operator.schema_parts import (
    Schema,
    conditions,
    int32,
    placement,
    pull_secrets,
    replica_status,
    resource_schema,
    string,
)
from kvrelay_operator.schema_rdma import kv_transfer_schema
from kvrelay_operator.schema_upgrade import (
    image_status_schema,
    rollout_status_schema,
    upgrade_schema,
)
from kvrelay_operator.spec import (
    DNS_1035,
    HUB_ID_PATTERN,
    HUB_REVISION_PATTERN,
    MAX_NAME_LENGTH,
    MODEL_SOURCES,
)


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
            "drainTimeoutSeconds": int32(
                "How long a shrink waits for the workers it removes to finish their requests "
                "(the router stops sending them new ones first); streams still running then "
                "move to other workers when the pod goes.",
                minimum=0,
                maximum=86400,
                default=300,
            ),
        },
    }


def service_schema() -> Schema:
    """The openAPIV3Schema of KVRelayService (spec and status)."""
    return resource_schema(
        _service_spec(),
        _service_status(),
        validations=[
            {
                "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                "message": f"name must be at most {MAX_NAME_LENGTH} characters",
            },
            {
                # `<name>-router` is a Service and KubeRay names pods after it: DNS-1035.
                "rule": f"self.metadata.name.matches('{DNS_1035.pattern}')",
                "message": "name must be a DNS-1035 label: lowercase letters, digits and '-', "
                "starting with a letter, no dots (e.g. llama3-1, not llama3.1)",
            },
        ],
    )


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
            "imagePullSecrets": pull_secrets(),
            "kvTransfer": kv_transfer_schema(),
            "ray": _ray_schema(),
            "monitoring": _monitoring_schema(),
            "upgrade": upgrade_schema(),
        },
    }


def _hub_schema() -> Schema:
    return {
        "type": "object",
        "description": "A Hugging Face model: each pod's init container pulls what kvrelay "
        "loads (config, safetensors or the GGUF a --quantization reads, tokenizer) into the "
        "cache volume, and kvrelay serves it with HF_HUB_OFFLINE=1. A commit as the revision "
        "pins every pod to the same files; a branch is resolved by each pod's pull (the router "
        "passes its commit to the workers, which refuse a different one).",
        "required": ["id"],
        "properties": {
            "id": string("ORG/NAME, e.g. Qwen/Qwen3-0.6B.", pattern=HUB_ID_PATTERN),
            "revision": string(
                "Branch, tag or commit.", default="main", pattern=HUB_REVISION_PATTERN
            ),
            "tokenSecret": {
                "type": "object",
                "description": "A Secret holding a Hugging Face token (HF_TOKEN) for gated "
                "or private models; only the pull sees it.",
                "required": ["name"],
                "properties": {
                    "name": string("Secret name.", minLength=1),
                    "key": string("Key of the token in the Secret.", default="token"),
                },
            },
        },
    }


def _model_schema() -> Schema:
    """Where the model comes from: the default, a claim, an image, a folder or the Hub."""
    return {
        "type": "object",
        "description": "Where the model comes from.",
        "default": {},
        "properties": {
            "source": string(
                "default: the embedded SmolLM2-135M-Instruct, fetched into the cache; "
                "pvc: a Hugging Face folder on a PersistentVolumeClaim; image: one in an OCI "
                "image mounted as a volume; folder: one already in the kvrelay image; hub: a "
                "Hugging Face id, pulled into the cache by an init container. pvc and image "
                "fetch nothing at start (air-gapped clusters).",
                enum=list(MODEL_SOURCES),
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
            "image": {
                "type": "object",
                "description": "An OCI image holding a Hugging Face folder, mounted read-only at "
                "/models (an image volume: Kubernetes' ImageVolume feature). Pushed to the "
                "cluster's registry, it serves air-gapped clusters.",
                "required": ["reference"],
                "properties": {
                    "reference": string("Image reference.", minLength=1),
                    "path": string(
                        "Folder inside the image, relative.",
                        default="",
                        pattern=r"^([^/.][^/]*(/[^/]+)*)?$",
                    ),
                    "pullPolicy": string(
                        "Pull policy.",
                        enum=["Always", "IfNotPresent", "Never"],
                        default="IfNotPresent",
                    ),
                },
            },
            "hub": _hub_schema(),
            "folder": {
                "type": "object",
                "required": ["path"],
                "description": "A Hugging Face folder at an absolute path in the image.",
                "properties": {"path": string("Absolute folder path.", pattern=r"^/.+")},
            },
            "cache": model_cache_schema(),
            "cacheClaimName": string(
                "A PersistentVolumeClaim for KVRELAY_CACHE_DIR, so the default model is "
                "fetched once; empty gives each pod its own emptyDir."
            ),
        },
        "x-kubernetes-validations": [
            model_cache_rule(),
            {"rule": "self.source != 'pvc' || has(self.pvc)", "message": "source pvc needs pvc"},
            {
                "rule": "self.source != 'image' || has(self.image)",
                "message": "source image needs image",
            },
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
                "without it the operator creates <name>-api-key with a random key.",
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
            "generation": string("The worker generation the routers serve (a hash)."),
            "rollout": rollout_status_schema(),
            "image": image_status_schema(),
            "scaleDown": {
                "type": "object",
                "description": "Shrinks in progress: the pods being drained, per pool.",
                "properties": {"prefill": _scale_down(), "decode": _scale_down()},
            },
        },
    }


def _scale_down() -> Schema:
    return {
        "type": "object",
        "properties": {
            "pods": {"type": "array", "items": {"type": "string"}},
            "replicas": int32("The size once these pods are gone."),
            "from": int32("The size before the shrink."),
            "phase": string("Draining, then Deleting.", enum=["Draining", "Deleting"]),
            "startedAt": {"type": "string", "format": "date-time"},
        },
    }
