"""Every `KVRELAY_*` environment variable the `kvrelay` package reads, declared once: its name,
type, default and what it does. docs/operations.md lists them (tests/test_env_registry.py
checks the table against `REGISTRY`, and that no other module spells a name).

A read happens at call time, never at import: `CACHE_DIR.get()` looks at `os.environ` now (or
at the mapping it is given), so a pod's environment, a test's `monkeypatch.setenv` and a
benchmark's temporary setting all count. What a value means (a choice, a path) stays with the
code that uses it; this module names the variables and says what an unset one reads as.

Two other packages keep their own, for layering: `kvrelay_kernels.env` (KVRELAY_HUGE_PAGES;
the kernels are beneath kvrelay and cannot import it) and `kvrelay_operator.env` (the names
the operator sets on its pods, and the two it reads; it imports neither kvrelay nor torch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `get` reads it; the rest documents it."""

    name: str
    type: str  # what a value is, as people write it ("path", "`auto` | `torch`")
    default: str  # what `get` returns when the variable is unset
    meaning: str
    unset: str = ""  # what an unset variable means, where `default` alone does not say

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        """The value in `environ` (None: `os.environ`, read now), else `default`."""
        return (os.environ if environ is None else environ).get(self.name, self.default)

    def choice(self, choices: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
        """The value (empty: `default`), one of `choices`.

        Raises:
            ValueError: another value, naming the variable and the choices.
        """
        value = self.get(environ) or self.default
        if value not in choices:
            raise ValueError(f"{self.name}={value!r}: use one of {', '.join(choices)}")
        return value

    def shown_default(self) -> str:
        """The default as docs/operations.md states it."""
        return self.unset or (f"`{self.default}`" if self.default else "unset")


API_KEY = EnvVar(
    "KVRELAY_API_KEY",
    "string",
    "",
    "the API key `kvrelay serve` / `router` require (`--api-key-env` names another "
    "variable), and the one the SDK and `kvrelay chat --url` send; the operator sets it on "
    "router pods from `apiKeySecret`",
    unset="unset: no key",
)
CACHE_DIR = EnvVar(
    "KVRELAY_CACHE_DIR",
    "path",
    "",
    "where the default model is converted and kept (`models/default_model.py`)",
    unset="`~/.cache/kvrelay`",
)
ENGINE_ARGS = EnvVar(
    "KVRELAY_ENGINE_ARGS",
    "engine flags",
    "",
    "engine flags a worker applies on top of the router's, e.g. `--max-num-seqs 64 "
    "--kv-cache-memory 2GiB` (`worker/engine_builder.py`); the operator sets it per pool",
    unset="empty",
)
CPU_AUTO_DTYPE = EnvVar(
    "KVRELAY_CPU_AUTO_DTYPE",
    "`float32` \\| `bfloat16`",
    "",
    "what `--dtype auto` means on a CPU (`engine/device.py`); prefill and decode pools must "
    "agree; the test suite pins `float32`",
    unset="unset: bf16 where the CPU computes bf16 natively, else fp32",
)
CPU_QUANT_KERNEL = EnvVar(
    "KVRELAY_CPU_QUANT_KERNEL",
    "`auto` \\| `torch`",
    "auto",
    "`torch`: quantized layers use torch's int4 kernel only, not kvrelay's block kernel (for "
    "comparisons; `models/quantized.py`)",
)
CPU_SINGLE_ROW = EnvVar(
    "KVRELAY_CPU_SINGLE_ROW",
    "`auto` \\| `packed` \\| `dense`",
    "auto",
    "path of one-row fp32 matmuls: `packed` (oneDNN) or `dense` (`W @ x.T`); `auto` measures "
    "both at load (`models/single_row.py`)",
)
CPU_MANY_ROWS = EnvVar(
    "KVRELAY_CPU_MANY_ROWS",
    "`auto` \\| `blocked` \\| `onednn`",
    "auto",
    "path of bf16 matmuls of 2 rows or more (prefill chunks, decode batches): `blocked` "
    "(kvrelay's kernel), `onednn` (torch's linear: AMX tiles where the CPU has them); `auto` "
    "times both per weight shape at load and takes oneDNN from the row count where it wins "
    "(`models/many_rows.py`)",
)
KV_HOST = EnvVar(
    "KVRELAY_KV_HOST",
    "address",
    "",
    "address the KV servers, UCX and the output stream bind (a pod: its IP, which the "
    "operator sets from status.podIP; `transfer/network.py`)",
    unset="`127.0.0.1`",
)
KV_ADVERTISE_HOST = EnvVar(
    "KVRELAY_KV_ADVERTISE_HOST",
    "address",
    "",
    "address peers dial, when it differs from the bound one (a wildcard bind needs it)",
    unset="`$KVRELAY_KV_HOST`",
)
KV_SECRET = EnvVar(
    "KVRELAY_KV_SECRET",
    "string",
    "",
    "the KV pull secret itself (`transfer/kv_secret.py`)",
)
KV_SECRET_FILE = EnvVar(
    "KVRELAY_KV_SECRET_FILE",
    "path",
    "",
    "a file holding the KV pull secret (a mounted Secret; the operator sets it); `serve` makes "
    "a random secret when neither this nor `KVRELAY_KV_SECRET` is set",
)
KV_TLS_CERT = EnvVar(
    "KVRELAY_KV_TLS_CERT",
    "path (PEM)",
    "",
    "this worker's certificate (chain) for mTLS on the gRPC KV channel; the cert, key and CA "
    "are set all three or none (`transfer/tls.py`)",
    unset="unset: plaintext",
)
KV_TLS_KEY = EnvVar(
    "KVRELAY_KV_TLS_KEY",
    "path (PEM)",
    "",
    "its private key (with `KVRELAY_KV_TLS_CERT`)",
    unset="unset: plaintext",
)
KV_TLS_CA = EnvVar(
    "KVRELAY_KV_TLS_CA",
    "path (PEM)",
    "",
    "the CA that signs every worker's certificate (with `KVRELAY_KV_TLS_CERT`)",
    unset="unset: plaintext",
)
KV_TLS_SERVER_NAME = EnvVar(
    "KVRELAY_KV_TLS_SERVER_NAME",
    "host name",
    "",
    "the name peers' certificates are checked against, when not the address dialled",
)
GENERATION = EnvVar(
    "KVRELAY_GENERATION",
    "string (hash)",
    "",
    "the deployment revision's hash: routers pair prefill and decode workers of one revision "
    "and prefer their own (set by the operator; the name keeps the older word)",
    unset="empty: any revision",
)
POD_NAME = EnvVar(
    "KVRELAY_POD_NAME",
    "string",
    "",
    "names the worker `kvrelay-<role>-<pod>` (set by the operator from metadata.name)",
    unset="the host name (`kvrelay worker`: a random id)",
)
NODE_NAME = EnvVar(
    "KVRELAY_NODE_NAME",
    "string",
    "",
    "the Kubernetes node a worker runs on, in its description (set by the operator)",
    unset="empty",
)

HEAP_TRIM_S = EnvVar(
    "KVRELAY_HEAP_TRIM_S",
    "seconds",
    "10",
    "a worker returns glibc's freed heap to the system (`malloc_trim`) when its engine goes "
    "idle, at most this often, and between two steps after six intervals without an idle "
    "moment; `0` never trims (`worker/heap_trim.py`)",
)
MEMORY_PROBE = EnvVar(
    "KVRELAY_MEMORY_PROBE",
    "path (a directory)",
    "",
    "each worker appends a JSON line of its memory (smaps, glibc's heap, live objects, "
    "per-request structures) to `memory-<pid>.jsonl` there (`worker/memory_probe.py`; "
    "`benchmarks/memory_soak.py --probe`); the live-object count pauses the worker's other "
    "threads while it runs (tens of ms per million objects)",
    unset="unset: no probe",
)
MEMORY_PROBE_S = EnvVar(
    "KVRELAY_MEMORY_PROBE_S",
    "seconds",
    "30",
    "seconds between two lines of the memory probe",
)
MEMORY_PROBE_TRACEMALLOC = EnvVar(
    "KVRELAY_MEMORY_PROBE_TRACEMALLOC",
    "`1` or unset",
    "",
    "`1`: the memory probe also records tracemalloc's growth by line (slow; for finding a leak)",
    unset="unset: off",
)
TEST_KUBECONFIG = EnvVar(
    "KVRELAY_TEST_KUBECONFIG",
    "path",
    "",
    "the operator's integration tests (`tests/operator/cluster.py`) run against the API server "
    "this kubeconfig names (kind, k3d, any cluster) instead of the in-process fake: CRDs "
    "applied, the operator as its ServiceAccount; see docs/deploy.md",
    unset="unset: the fake API server",
)
CORE_SHARE = EnvVar(
    "KVRELAY_CORE_SHARE",
    "`auto` \\| `on` \\| `off`",
    "auto",
    "how `kvrelay serve`'s workers use a small machine's cores: P/D workers share them step "
    "by step (the prefill worker runs a step on its share plus the cores the other workers "
    "leave idle, when no other process runs: a lone prompt on all of them while the decode "
    "worker has nothing running; decode workers keep their share); a colocated worker's "
    "OpenMP team threads spin briefly at a barrier, then sleep (`GOMP_SPINCOUNT=1000`, "
    "unless the environment sets an OpenMP wait). `auto`: on machines of at most 4 cores, "
    "when `serve` starts its own Ray; `on`: on any; `off`: neither (`worker/core_share.py`)",
)
CORE_BOARD = EnvVar(
    "KVRELAY_CORE_BOARD",
    "path",
    "",
    "the shared file (in `/dev/shm`) on which workers publish the threads they run; `kvrelay "
    "serve` sets it for its workers where `KVRELAY_CORE_SHARE` says so; not for people to set",
    unset="unset: each worker keeps its share",
)
REGISTRY: tuple[EnvVar, ...] = (
    API_KEY,
    CACHE_DIR,
    ENGINE_ARGS,
    CPU_AUTO_DTYPE,
    CPU_QUANT_KERNEL,
    CPU_SINGLE_ROW,
    CPU_MANY_ROWS,
    KV_HOST,
    KV_ADVERTISE_HOST,
    KV_SECRET,
    KV_SECRET_FILE,
    KV_TLS_CERT,
    KV_TLS_KEY,
    KV_TLS_CA,
    KV_TLS_SERVER_NAME,
    GENERATION,
    POD_NAME,
    NODE_NAME,
    HEAP_TRIM_S,
    MEMORY_PROBE,
    MEMORY_PROBE_S,
    MEMORY_PROBE_TRACEMALLOC,
    TEST_KUBECONFIG,
    CORE_SHARE,
    CORE_BOARD,
)
