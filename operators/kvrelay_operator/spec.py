"""A KVRelayService's spec as frozen dataclasses, parsed once from the custom resource.

The API server has already applied the CRD's defaults and checks; the defaults here only
matter for objects read without them (tests, dry runs) and must match `crds.py`, which a
test checks. Nothing here talks to Kubernetes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.errors import SpecError

_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s)$")


def parse_target(metric: str, text: str) -> float:
    """An SLO target in seconds (ttft, itl) or as a ratio in [0, 1] (kvUsage)."""
    match = _DURATION.match(text)
    if metric == "kvUsage":
        if match:
            raise SpecError(f"kvUsage target {text!r} must be a ratio such as 0.8")
        try:
            ratio = float(text)
        except ValueError:
            raise SpecError(f"kvUsage target {text!r} is not a number") from None
        if not 0 < ratio <= 1:
            raise SpecError(f"kvUsage target {text!r} must be in (0, 1]")
        return ratio
    if not match:
        raise SpecError(f"{metric} target {text!r} must be a duration such as 500ms")
    value = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
    if value <= 0:
        raise SpecError(f"{metric} target {text!r} must be positive")
    return value


@dataclass(frozen=True)
class Placement:
    """Where and how big: resources, node selector and tolerations, as Kubernetes spells them."""

    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> Placement:
        return Placement(
            resources=dict(raw.get("resources") or {}),
            node_selector=dict(raw.get("nodeSelector") or {}),
            tolerations=tuple(raw.get("tolerations") or ()),
        )


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    metric: str = "ttft"
    target: float = 0.5  # seconds for ttft / itl, a ratio for kvUsage
    percentile: int = 90
    tolerance: float = 0.1
    scale_up_cooldown_s: int = 60
    scale_down_cooldown_s: int = 300

    @staticmethod
    def parse(pool: str, raw: Mapping[str, Any]) -> Autoscaling:
        metric = str(raw.get("metric", "ttft" if pool == "prefill" else "itl"))
        allowed = ("ttft",) if pool == "prefill" else ("itl", "kvUsage")
        if metric not in allowed:
            raise SpecError(f"{pool}.autoscaling.metric {metric!r} is not one of {allowed}")
        auto = Autoscaling(
            enabled=bool(raw.get("enabled", False)),
            min_replicas=int(raw.get("minReplicas", 1)),
            max_replicas=int(raw.get("maxReplicas", 4)),
            metric=metric,
            target=parse_target(metric, str(raw.get("target", _default_target(pool)))),
            percentile=int(raw.get("percentile", 90)),
            tolerance=float(raw.get("tolerance", 0.1)),
            scale_up_cooldown_s=int(raw.get("scaleUpCooldownSeconds", 60)),
            scale_down_cooldown_s=int(raw.get("scaleDownCooldownSeconds", 300)),
        )
        if not 1 <= auto.min_replicas <= auto.max_replicas:
            raise SpecError(
                f"{pool}.autoscaling needs 1 <= minReplicas ({auto.min_replicas}) <= "
                f"maxReplicas ({auto.max_replicas})"
            )
        return auto


def _default_target(pool: str) -> str:
    return "500ms" if pool == "prefill" else "100ms"


@dataclass(frozen=True)
class PoolSpec:
    name: str  # "prefill" or "decode"
    replicas: int = 1  # the count a new KVRelayPool starts with
    cpus_per_worker: int = 2
    engine_args: tuple[str, ...] = ()
    placement: Placement = field(default_factory=Placement)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)

    @staticmethod
    def parse(name: str, raw: Mapping[str, Any]) -> PoolSpec:
        replicas = int(raw.get("replicas", 1))
        if replicas < 0:
            raise SpecError(f"{name}.replicas must be >= 0, got {replicas}")
        return PoolSpec(
            name=name,
            replicas=replicas,
            cpus_per_worker=int(raw.get("cpusPerWorker", 2)),
            engine_args=tuple(raw.get("engineArgs") or ()),
            placement=Placement.parse(raw),
            autoscaling=Autoscaling.parse(name, raw.get("autoscaling") or {}),
        )


@dataclass(frozen=True)
class ModelSource:
    source: str = "default"  # default | pvc | folder
    pvc_claim: str = ""
    pvc_path: str = ""
    folder: str = ""
    cache_claim: str = ""

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> ModelSource:
        source = str(raw.get("source", "default"))
        pvc = raw.get("pvc") or {}
        folder = raw.get("folder") or {}
        model = ModelSource(
            source=source,
            pvc_claim=str(pvc.get("claimName", "")),
            pvc_path=str(pvc.get("path", "")),
            folder=str(folder.get("path", "")),
            cache_claim=str(raw.get("cacheClaimName", "")),
        )
        if source == "pvc" and not model.pvc_claim:
            raise SpecError("model.source pvc needs model.pvc.claimName")
        if source == "folder" and not model.folder.startswith("/"):
            raise SpecError("model.source folder needs an absolute model.folder.path")
        if source not in ("default", "pvc", "folder"):
            raise SpecError(f"model.source {source!r} is not one of default, pvc, folder")
        return model


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 2
    service_type: str = "ClusterIP"
    api_key_secret: str = ""
    api_key_key: str = "api-key"
    placement: Placement = field(default_factory=Placement)

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> RouterSpec:
        secret = raw.get("apiKeySecret") or {}
        return RouterSpec(
            replicas=int(raw.get("replicas", 2)),
            service_type=str(raw.get("serviceType", "ClusterIP")),
            api_key_secret=str(secret.get("name", "")),
            api_key_key=str(secret.get("key", "api-key")),
            placement=Placement.parse(raw),
        )


@dataclass(frozen=True)
class ServiceSpec:
    """Everything the reconciler needs to know about one KVRelayService."""

    name: str
    namespace: str
    uid: str
    generation: int
    image: str
    image_pull_policy: str = "IfNotPresent"
    model: ModelSource = field(default_factory=ModelSource)
    engine_args: tuple[str, ...] = ()
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec("prefill"))
    decode: PoolSpec = field(default_factory=lambda: PoolSpec("decode"))
    router: RouterSpec = field(default_factory=RouterSpec)
    transfer_backend: str = "nixl"
    ray_version: str = "2.60.0"
    ray_head: Placement = field(default_factory=Placement)
    service_monitor: bool = False
    service_monitor_interval: str = "15s"
    service_monitor_labels: Mapping[str, str] = field(default_factory=dict)

    def pool(self, name: str) -> PoolSpec:
        if name == "prefill":
            return self.prefill
        if name == "decode":
            return self.decode
        raise KeyError(name)


def parse_service(body: Mapping[str, Any], default_image: str) -> ServiceSpec:
    """Parse a KVRelayService object (as read from the API) into a `ServiceSpec`.

    Raises:
        SpecError: the spec is inconsistent in a way retrying cannot fix.
    """
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    image = str(spec.get("image") or default_image)
    if not image:
        raise SpecError("spec.image is empty and the operator has no default image")
    ray = spec.get("ray") or {}
    monitor = (spec.get("monitoring") or {}).get("serviceMonitor") or {}
    return ServiceSpec(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "default")),
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation", 0)),
        image=image,
        image_pull_policy=str(spec.get("imagePullPolicy", "IfNotPresent")),
        model=ModelSource.parse(spec.get("model") or {}),
        engine_args=tuple(spec.get("engineArgs") or ()),
        prefill=PoolSpec.parse("prefill", spec.get("prefill") or {}),
        decode=PoolSpec.parse("decode", spec.get("decode") or {}),
        router=RouterSpec.parse(spec.get("router") or {}),
        transfer_backend=str((spec.get("kvTransfer") or {}).get("backend", "nixl")),
        ray_version=str(ray.get("rayVersion", "2.60.0")),
        ray_head=Placement.parse(ray.get("head") or {}),
        service_monitor=bool(monitor.get("enabled", False)),
        service_monitor_interval=str(monitor.get("interval", "15s")),
        service_monitor_labels=dict(monitor.get("labels") or {}),
    )
