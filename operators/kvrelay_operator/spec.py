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
from kvrelay_operator.model_cache import ModelCache
from kvrelay_operator.rdma import TransportSettings
from kvrelay_operator.upgrade import UpgradeSpec

_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s)$")
# A Service name (`<name>-router`) and KubeRay's names must be DNS-1035 labels: a lowercase
# letter first, no dots. The CRD checks the same pattern (crds.NAME_PATTERN).
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Names feed child names such as `<name>-<revision>-head-svc`, which must stay 63 characters.
MAX_NAME_LENGTH = 40
# A Hugging Face model id, ORG/NAME: the Hub's rule, as kvrelay.common.model_ref checks it
# (this package imports no kvrelay); the CRD checks HUB_ID_PATTERN, the rest (no '--' or
# '..') is checked here. A revision: a branch, tag or commit, no '@' or whitespace.
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID_PATTERN = rf"^{_HUB_PART}/{_HUB_PART}$"
HUB_REVISION_PATTERN = r"^[^\s@]{1,255}$"


def check_name(name: str) -> str:
    """`name` if it can name every child; a SpecError that says what to change otherwise."""
    if not DNS_1035.match(name) or len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            f"name {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters: "
            "lowercase letters, digits and '-', starting with a letter, no dots "
            "(e.g. llama3-1 rather than llama3.1)"
        )
    return name


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
    """Where and how a group of pods runs, as Kubernetes spells it: resources, scheduling
    (node selector, tolerations, affinity, topology spread, priority), the container runtime
    class and the image pull secrets."""

    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    topology_spread: tuple[Mapping[str, Any], ...] = ()
    priority_class: str = ""
    runtime_class: str = ""
    pull_secrets: tuple[str, ...] = ()

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> Placement:
        return Placement(
            resources=dict(raw.get("resources") or {}),
            node_selector=dict(raw.get("nodeSelector") or {}),
            tolerations=tuple(raw.get("tolerations") or ()),
            affinity=dict(raw.get("affinity") or {}),
            topology_spread=tuple(raw.get("topologySpreadConstraints") or ()),
            priority_class=str(raw.get("priorityClassName") or ""),
            runtime_class=str(raw.get("runtimeClassName") or ""),
            pull_secrets=_secret_names(raw.get("imagePullSecrets")),
        )


def _secret_names(raw: Any) -> tuple[str, ...]:
    return tuple(str(ref["name"]) for ref in raw or () if ref.get("name"))


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
    # How long a shrink waits for the workers it removes to finish their requests.
    drain_timeout_s: int = 300

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
            drain_timeout_s=int(raw.get("drainTimeoutSeconds", 300)),
        )


@dataclass(frozen=True)
class ModelSource:
    source: str = "default"  # default | pvc | image | folder | hub
    pvc_claim: str = ""
    pvc_path: str = ""
    folder: str = ""
    cache_claim: str = ""
    # source image: an OCI image holding the model folder, mounted as an image volume.
    image_ref: str = ""
    image_path: str = ""
    image_pull_policy: str = "IfNotPresent"
    # source hub: a Hugging Face id at a revision, pulled into the cache volume by an init
    # container (the only pod part with the network and the token Secret, if one is named).
    hub_id: str = ""
    hub_revision: str = "main"
    hub_token_secret: str = ""
    hub_token_key: str = "token"
    # The default model fetched once into a shared claim by one Job (model_cache.py).
    cache: ModelCache = field(default_factory=ModelCache)

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> ModelSource:
        source = str(raw.get("source", "default"))
        pvc = raw.get("pvc") or {}
        folder = raw.get("folder") or {}
        image = raw.get("image") or {}
        hub = raw.get("hub") or {}
        token = hub.get("tokenSecret") or {}
        model = ModelSource(
            source=source,
            pvc_claim=str(pvc.get("claimName", "")),
            pvc_path=str(pvc.get("path", "")),
            folder=str(folder.get("path", "")),
            cache_claim=str(raw.get("cacheClaimName", "")),
            image_ref=str(image.get("reference", "")),
            image_path=str(image.get("path", "")),
            image_pull_policy=str(image.get("pullPolicy", "IfNotPresent")),
            hub_id=str(hub.get("id", "")),
            hub_revision=str(hub.get("revision", "main")),
            hub_token_secret=str(token.get("name", "")),
            hub_token_key=str(token.get("key", "token")),
            cache=ModelCache.parse(raw.get("cache") or {}, source),
        )
        if source not in MODEL_SOURCES:
            raise SpecError(f"model.source {source!r} is not one of {', '.join(MODEL_SOURCES)}")
        if source == "pvc" and not model.pvc_claim:
            raise SpecError("model.source pvc needs model.pvc.claimName")
        if source == "image" and not model.image_ref:
            raise SpecError("model.source image needs model.image.reference")
        if source == "folder" and not model.folder.startswith("/"):
            raise SpecError("model.source folder needs an absolute model.folder.path")
        if source == "hub":
            _check_hub(model)
        return model

    @property
    def mounted(self) -> bool:
        """Whether the model is a volume at MODEL_MOUNT (nothing to fetch: air-gap safe)."""
        return self.source in ("pvc", "image")


MODEL_SOURCES = ("default", "pvc", "image", "folder", "hub")


def _check_hub(model: ModelSource) -> None:
    """A SpecError unless `model.hub` names an ORG/NAME id and a revision."""
    hub_id = model.hub_id
    if not re.match(HUB_ID_PATTERN, hub_id) or ".." in hub_id or "--" in hub_id:
        raise SpecError(
            f"model.hub.id {hub_id!r} must be a Hugging Face id ORG/NAME (letters, digits, "
            "'-', '_', '.'; e.g. Qwen/Qwen3-0.6B)"
        )
    if not re.match(HUB_REVISION_PATTERN, model.hub_revision):
        raise SpecError(
            f"model.hub.revision {model.hub_revision!r} must be a branch, tag or commit "
            "(no '@' or spaces)"
        )


@dataclass(frozen=True)
class KVTransferSpec:
    """How KV blocks move between the pools' pods, and what the pods need for it."""

    backend: str = "nixl"
    # A Secret (key `secret`) every worker and router mounts; empty: the operator creates
    # `<service>-kv` once with a random key.
    secret_name: str = ""
    ucx_tls: str = ""  # UCX_TLS, e.g. rc,cuda_copy,cuda_ipc
    ucx_net_devices: str = ""  # UCX_NET_DEVICES, e.g. mlx5_0:1
    rdma_resources: Mapping[str, Any] = field(default_factory=dict)  # device plugin resources
    host_network: bool = False
    # Privilege, memlock, hugepages, /dev/shm and extra env of the worker pods (rdma.py).
    transport: TransportSettings = field(default_factory=TransportSettings)

    @property
    def ipc_lock(self) -> bool:
        """CAP_IPC_LOCK is added only where it takes effect (rdma.py says why)."""
        return self.transport.ipc_lock

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> KVTransferSpec:
        ucx = raw.get("ucx") or {}
        rdma = raw.get("rdma") or {}
        return KVTransferSpec(
            backend=str(raw.get("backend", "nixl")),
            secret_name=str(raw.get("secretName") or ""),
            ucx_tls=str(ucx.get("tls") or ""),
            ucx_net_devices=str(ucx.get("netDevices") or ""),
            rdma_resources=dict(rdma.get("resources") or {}),
            host_network=bool(raw.get("hostNetwork", False)),
            transport=TransportSettings.parse(raw),
        )


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
    kv: KVTransferSpec = field(default_factory=KVTransferSpec)
    pull_secrets: tuple[str, ...] = ()  # every pod's, besides each group's own
    ray_version: str = "2.60.0"
    ray_head: Placement = field(default_factory=Placement)
    service_monitor: bool = False
    service_monitor_interval: str = "15s"
    service_monitor_labels: Mapping[str, str] = field(default_factory=dict)
    # The kvrelay the operator runs. Not part of the revision: what it puts into the pods
    # is, through the rendered pod templates (revision.py), so an operator upgrade that
    # renders the same pods rolls nothing.
    kvrelay_version: str = ""
    upgrade: UpgradeSpec = field(default_factory=UpgradeSpec)

    @property
    def transfer_backend(self) -> str:
        return self.kv.backend

    def pool(self, name: str) -> PoolSpec:
        if name == "prefill":
            return self.prefill
        if name == "decode":
            return self.decode
        raise KeyError(name)


def installed_version() -> str:
    """The kvrelay distribution's version, "" when it is not installed (a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvrelay")
    except PackageNotFoundError:
        return ""


def parse_service(
    body: Mapping[str, Any], default_image: str, kvrelay_version: str | None = None
) -> ServiceSpec:
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
        name=check_name(str(meta.get("name", ""))),
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
        kv=KVTransferSpec.parse(spec.get("kvTransfer") or {}),
        pull_secrets=_secret_names(spec.get("imagePullSecrets")),
        ray_version=str(ray.get("rayVersion", "2.60.0")),
        ray_head=Placement.parse(ray.get("head") or {}),
        service_monitor=bool(monitor.get("enabled", False)),
        service_monitor_interval=str(monitor.get("interval", "15s")),
        service_monitor_labels=dict(monitor.get("labels") or {}),
        kvrelay_version=installed_version() if kvrelay_version is None else kvrelay_version,
        upgrade=UpgradeSpec.parse(spec.get("upgrade") or {}),
    )
