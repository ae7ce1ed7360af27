"""What the KV transport asks of a worker pod: RDMA privileges that take effect, memlock,
hugepages, `/dev/shm`, any `UCX_*` and extra env, and node exclusivity for hostNetwork.

`TransportSettings.parse` reads `spec.kvTransfer` (the CRD's schema_rdma.py has the same
rules as CEL) and refuses what cannot work; `apply_to_worker` edits a rendered worker group
template. Pure; nothing here talks to Kubernetes or imports spec.py.

Why the privilege is a choice (Linux, not Kubernetes, decides): registering memory for RDMA
needs CAP_IPC_LOCK in the *effective* set, or a memlock limit (`ulimit -l`) large enough.
A capability in `securityContext.capabilities.add` reaches a non-root process's effective
set only through ambient capabilities, which Kubernetes does not set; so for the image's
uid 1000 it has no effect. Hence:

- `Unprivileged` (default): no capability; RDMA works where the container runtime gives
  containers an unlimited memlock (containerd's and CRI-O's systemd units set
  LimitMEMLOCK=infinity on most GPU nodes; `ulimit -l` in a pod shows it).
- `Root`: the worker runs as uid 0 with IPC_LOCK (effective for root).
- `FileCapabilities`: uid 1000 runs a python carrying `cap_ipc_lock+ep` as a file capability
  (the image built with `--build-arg PYTHON_FILE_CAPS=cap_ipc_lock+ep`); the capability must
  be in the bounding set (added here) and privilege escalation allowed, since
  no_new_privs would drop file capabilities at exec.

memlock cannot be set per pod in Kubernetes; `memlock: Unlimited` runs `ulimit -l unlimited`
in the worker's shell before KubeRay's `ray start` (KubeRay's overwrite-container-cmd
annotation), which needs CAP_SYS_RESOURCE in effect: root only.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.env import CACHE_DIR_ENV
from kvrelay_operator.errors import SpecError

Obj = dict[str, Any]

PRIVILEGES = ("Unprivileged", "Root", "FileCapabilities")
MEMLOCK = ("Runtime", "Unlimited")
HUGEPAGE_SIZES = ("2Mi", "1Gi")
DEFAULT_SHM = "1Gi"
UCX_NAME = r"^UCX_[A-Z0-9_]+$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# UCX transports that only reach a peer in the same IPC (or host) namespace: between two
# pods (each its own IPC namespace, never hostIPC here) they never connect. A UCX_TLS made
# of these alone leaves the pods no way to reach each other. `self` is loopback only.
INTRA_NODE_TLS = (
    "self|sm|shm|posix|sysv|xpmem|cma|knem|cuda_ipc|rocm_ipc|cuda_copy|rocm_copy|gdr_copy"
)
INTRA_ONLY_TLS = rf"^\s*({INTRA_NODE_TLS})\s*(,\s*({INTRA_NODE_TLS})\s*)*$"
# Set through their own fields (ucx.tls / ucx.netDevices) or by the operator itself.
_UCX_OWN = ("UCX_TLS", "UCX_NET_DEVICES")
# kvrelay's own prefix, as env.py's names spell it.
RESERVED_ENV_PREFIXES = (CACHE_DIR_ENV.split("_")[0] + "_", "RAY_", "UCX_")
RESERVED_ENV = ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN", "OMP_NUM_THREADS")
# KubeRay runs `$KUBERAY_GEN_RAY_START_CMD` itself unless a template carries this.
OVERWRITE_CMD = "ray.io/overwrite-container-cmd"
# KubeRay's own default command raises the open-files limit; ours must too.
MEMLOCK_ARGS = (
    'ulimit -n 65536; ulimit -l unlimited; exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"'
)
WORKER_COMPONENTS = ("prefill", "decode")


@dataclass(frozen=True)
class TransportSettings:
    """The pod-level settings of `spec.kvTransfer` beyond the backend and the secret."""

    privilege: str = "Unprivileged"
    memlock: str = "Runtime"
    hugepage_size: str = "2Mi"
    hugepages: str = ""  # total per pod, a quantity; empty: none
    shm_size: str = DEFAULT_SHM
    ucx_env: Mapping[str, str] = field(default_factory=dict)
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def ipc_lock(self) -> bool:
        """Whether IPC_LOCK is added: only where it takes effect."""
        return self.privilege != "Unprivileged"

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> TransportSettings:
        """Read `spec.kvTransfer`. Raises SpecError naming the field for what cannot work."""
        rdma = raw.get("rdma") or {}
        huge = rdma.get("hugepages") or {}
        ucx = raw.get("ucx") or {}
        settings = TransportSettings(
            privilege=str(rdma.get("privilege", "Unprivileged")),
            memlock=str(rdma.get("memlock", "Runtime")),
            hugepage_size=str(huge.get("pageSize", "2Mi")),
            hugepages=str(huge.get("size", "")),
            shm_size=str((raw.get("shm") or {}).get("sizeLimit", DEFAULT_SHM)),
            ucx_env={str(k): str(v) for k, v in (ucx.get("env") or {}).items()},
            extra_env={str(k): str(v) for k, v in (raw.get("workerEnv") or {}).items()},
        )
        _check_choices(settings)
        _check_ipc_lock(rdma, settings)
        check_ucx_tls(str(ucx.get("tls") or ""))
        _check_env(settings)
        return settings


def _check_choices(settings: TransportSettings) -> None:
    for name, value, allowed in (
        ("rdma.privilege", settings.privilege, PRIVILEGES),
        ("rdma.memlock", settings.memlock, MEMLOCK),
        ("rdma.hugepages.pageSize", settings.hugepage_size, HUGEPAGE_SIZES),
    ):
        if value not in allowed:
            raise SpecError(f"kvTransfer.{name} {value!r} is not one of {', '.join(allowed)}")
    if settings.memlock == "Unlimited" and settings.privilege != "Root":
        raise SpecError(
            "kvTransfer.rdma.memlock Unlimited raises the hard limit, which needs "
            "CAP_SYS_RESOURCE in effect: set rdma.privilege Root, or keep memlock Runtime and "
            "give containers an unlimited memlock in the container runtime"
        )


def _check_ipc_lock(rdma: Mapping[str, Any], settings: TransportSettings) -> None:
    if rdma.get("ipcLock") and not settings.ipc_lock:
        raise SpecError(
            "kvTransfer.rdma.ipcLock has no effect for the non-root worker (no ambient "
            "capabilities): set rdma.privilege Root or FileCapabilities, or remove ipcLock and "
            "rely on the container runtime's memlock limit"
        )


def check_ucx_tls(tls: str) -> None:
    """Refuse a UCX_TLS whose transports cannot connect two pods."""
    if tls and not tls.lstrip().startswith("^") and re.match(INTRA_ONLY_TLS, tls):
        raise SpecError(
            f"kvTransfer.ucx.tls {tls!r} names only same-host transports (shared memory, "
            "cuda_ipc, ...): these need a shared IPC namespace, which two pods never have, so "
            "prefill and decode could not connect. Add a network transport, e.g. rc,cuda_copy "
            "(RDMA) or tcp"
        )


def _check_env(settings: TransportSettings) -> None:
    for name in settings.ucx_env:
        if not re.match(UCX_NAME, name) or name in _UCX_OWN:
            raise SpecError(
                f"kvTransfer.ucx.env key {name!r} must be a UCX_* variable other than "
                f"{' and '.join(_UCX_OWN)} (those are ucx.tls and ucx.netDevices)"
            )
    for name in settings.extra_env:
        reserved = name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)
        if not re.match(ENV_NAME, name) or reserved:
            raise SpecError(
                f"kvTransfer.workerEnv key {name!r} must be an environment variable name the "
                f"operator does not set itself (not {', '.join(RESERVED_ENV)} nor "
                f"{'*, '.join(RESERVED_ENV_PREFIXES)}*; UCX_* goes in ucx.env)"
            )


def worker_env(settings: TransportSettings) -> list[Obj]:
    """The `UCX_*` and extra variables, sorted so the template does not churn."""
    pairs = sorted(settings.ucx_env.items()) + sorted(settings.extra_env.items())
    return [{"name": k, "value": v} for k, v in pairs]


def container_security(settings: TransportSettings, container: Obj) -> Obj:
    """The worker container's securityContext under `settings.privilege`. Root is set on
    the container only: the pod's init containers stay uid 1000."""
    out = copy.deepcopy(container)
    caps = ["IPC_LOCK"] if settings.ipc_lock else []
    if settings.memlock == "Unlimited":
        caps.append("SYS_RESOURCE")
    out["capabilities"] = {"drop": ["ALL"], **({"add": caps} if caps else {})}
    if settings.privilege == "Root":
        out.update(runAsNonRoot=False, runAsUser=0)
    if settings.privilege == "FileCapabilities":
        # no_new_privs (allowPrivilegeEscalation false) drops file capabilities at exec.
        out["allowPrivilegeEscalation"] = True
    return out


def volumes(settings: TransportSettings) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts): /dev/shm (NIXL/UCX shared memory) and the hugepages, if any."""
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}
    vols, mounts = [shm], [{"name": "dshm", "mountPath": "/dev/shm"}]
    if settings.hugepages:
        medium = f"HugePages-{settings.hugepage_size}"
        vols.append({"name": "hugepages", "emptyDir": {"medium": medium}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    return vols, mounts


def hugepage_resources(settings: TransportSettings) -> Obj:
    """Extended resources to add to requests and limits (Kubernetes wants them equal)."""
    if not settings.hugepages:
        return {}
    return {f"hugepages-{settings.hugepage_size}": settings.hugepages}


def host_network_anti_affinity(affinity: Mapping[str, Any]) -> Obj:
    """`affinity` plus a required term keeping this pod off nodes with a kvrelay worker:
    two hostNetwork workers on one node would bind the same Ray and KV ports."""
    out = copy.deepcopy(dict(affinity))
    anti = out.setdefault("podAntiAffinity", {})
    terms = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    terms.append(
        {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {
                "matchLabels": {"app.kubernetes.io/name": "kvrelay"},
                "matchExpressions": [
                    {
                        "key": "app.kubernetes.io/component",
                        "operator": "In",
                        "values": list(WORKER_COMPONENTS),
                    }
                ],
            },
        }
    )
    return out
