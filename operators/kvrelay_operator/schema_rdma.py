"""The CRD schema of `spec.kvTransfer`: backend, secret, UCX (any `UCX_*`), RDMA devices and
privilege, memlock, hugepages, /dev/shm, extra worker env and hostNetwork.

Pure data. The CEL rules here are the ones `rdma.TransportSettings.parse` applies to objects
read without the API server; a test checks both refuse the same specs. Every string a rule
reads has a maxLength: the API server refuses a CRD whose rules it cannot cost.
"""

from __future__ import annotations

from kvrelay_operator.rdma import (
    DEFAULT_SHM,
    HUGEPAGE_SIZES,
    INTRA_ONLY_TLS,
    MEMLOCK,
    PRIVILEGES,
)
from kvrelay_operator.schema_parts import Schema, object_name, quantity_map, string

# Kubernetes' quantity grammar, as the resource maps use it.
QUANTITY = quantity_map("")["additionalProperties"]["pattern"]


def _cel_string(text: str) -> str:
    """`text` inside a single-quoted CEL string literal: CEL reads backslash escapes."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _env_map(description: str) -> Schema:
    """Variable name -> value. The names are checked by the parser (rdma.py), not by CEL: a
    map key has no maxLength, so the API server would cost a regex over it as unbounded."""
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string", "maxLength": 4096},
        "maxProperties": 64,
    }


def _ucx_schema() -> Schema:
    return {
        "type": "object",
        "description": "UCX settings of the worker pods (nixl backend).",
        "properties": {
            "tls": string(
                "UCX_TLS. Between pods it must name a network transport: rc,cuda_copy (RDMA "
                "with GPUDirect) or tcp. Same-host ones (sm, cuda_ipc, ...) need a shared IPC "
                "namespace, which two pods never have.",
                # Bounded, so the API server can cost the CEL regex below.
                maxLength=256,
            ),
            "netDevices": string("UCX_NET_DEVICES, e.g. mlx5_0:1.", maxLength=256),
            "env": _env_map(
                "Any other UCX_* variable of the worker pods, e.g. UCX_IB_GID_INDEX: '3' "
                "(UCX_TLS and UCX_NET_DEVICES are tls and netDevices)."
            ),
        },
        "x-kubernetes-validations": [
            {
                "rule": f"!has(self.tls) || self.tls.startsWith('^') || "
                f"!self.tls.matches('{_cel_string(INTRA_ONLY_TLS)}')",
                "message": "ucx.tls names only same-host transports (shared memory, cuda_ipc): "
                "two pods share no IPC namespace, so they could not connect; add rc or tcp",
            },
            {
                "rule": "!has(self.env) || (!('UCX_TLS' in self.env) && "
                "!('UCX_NET_DEVICES' in self.env))",
                "message": "set UCX_TLS and UCX_NET_DEVICES with ucx.tls and ucx.netDevices",
            },
        ],
    }


def _rdma_schema() -> Schema:
    return {
        "type": "object",
        "description": "RDMA for the worker pods: devices, the privilege that lets the "
        "non-root worker pin memory, memlock and hugepages.",
        "default": {},
        "properties": {
            "resources": quantity_map(
                "Device plugin resources each worker pod gets (requests and limits), "
                "e.g. rdma/rdma_shared_device_a: 1."
            ),
            "privilege": string(
                "How the worker may pin memory for RDMA. Unprivileged: no capability (it "
                "would not take effect for uid 1000); the container runtime must give an "
                "unlimited memlock (containerd/CRI-O LimitMEMLOCK=infinity). Root: the worker "
                "container runs as uid 0 with IPC_LOCK. FileCapabilities: uid 1000 with an "
                "image whose python has cap_ipc_lock+ep (build arg PYTHON_FILE_CAPS), "
                "IPC_LOCK in the bounding set and privilege escalation allowed.",
                enum=list(PRIVILEGES),
                default="Unprivileged",
            ),
            "ipcLock": {
                "type": "boolean",
                "description": "Deprecated: IPC_LOCK is added exactly when privilege is Root "
                "or FileCapabilities; true with Unprivileged is refused (no effect).",
            },
            "memlock": string(
                "Runtime: the container runtime's memlock limit (not settable per pod in "
                "Kubernetes). Unlimited: `ulimit -l unlimited` before `ray start` (needs "
                "privilege Root: raising the hard limit takes CAP_SYS_RESOURCE).",
                enum=list(MEMLOCK),
                default="Runtime",
            ),
            "hugepages": {
                "type": "object",
                "description": "Hugepages per worker pod (requests = limits), mounted at "
                "/dev/hugepages (emptyDir medium HugePages-<pageSize>).",
                "required": ["size"],
                "properties": {
                    "pageSize": string("Page size.", enum=list(HUGEPAGE_SIZES), default="2Mi"),
                    "size": string("Total per pod, e.g. 2Gi.", pattern=QUANTITY),
                },
            },
        },
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.ipcLock) || !self.ipcLock || self.privilege != 'Unprivileged'",
                "message": "ipcLock has no effect for the non-root worker: set privilege Root "
                "or FileCapabilities, or drop ipcLock",
            },
            {
                "rule": "self.memlock != 'Unlimited' || self.privilege == 'Root'",
                "message": "memlock Unlimited needs privilege Root (CAP_SYS_RESOURCE)",
            },
        ],
    }


def kv_transfer_schema() -> Schema:
    """The KV relay between the pools' pods: transport, secret, UCX, RDMA and pod settings."""
    return {
        "type": "object",
        "description": "How KV blocks move from prefill to decode workers.",
        "default": {},
        "properties": {
            "backend": string(
                "nixl (UCX: RDMA or TCP) or grpc.", enum=["nixl", "grpc"], default="nixl"
            ),
            "secretName": object_name(
                "A Secret (key `secret`, at least 32 bytes) that authorizes KV pulls; empty: "
                "the operator creates <name>-kv with a random key."
            ),
            "ucx": _ucx_schema(),
            "rdma": _rdma_schema(),
            "shm": {
                "type": "object",
                "description": "/dev/shm of the worker pods (NIXL and UCX shared memory): a "
                "memory-backed emptyDir, counted in the pod's memory.",
                "default": {},
                "properties": {
                    "sizeLimit": string("Its size.", pattern=QUANTITY, default=DEFAULT_SHM)
                },
            },
            "workerEnv": _env_map(
                "Extra environment of the worker pods (e.g. NCCL_*, NIXL_*); names the "
                "operator sets (KVRELAY_*, RAY_*, UCX_*, HF_*, OMP_NUM_THREADS) are refused."
            ),
            "hostNetwork": {
                "type": "boolean",
                "description": "Run worker pods on the node's network (RDMA NICs no CNI "
                "hands to pods). A required pod anti-affinity then keeps them off nodes that "
                "run another kvrelay worker: Ray's and the KV ports would clash.",
                "default": False,
            },
        },
    }
