"""Real `kvrelay serve` processes for the API tests: started on free loopback ports, waited
for until /health answers 200, stopped with SIGTERM (the draining shutdown)."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.benchmarks.scripts import load_script

# One port policy for tests and benchmarks: benchmarks/serving/servers.py explains the range.
free_port: Callable[[], int] = load_script(
    Path(__file__).resolve().parents[1] / "benchmarks" / "serving" / "servers.py"
).free_port


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    http_port: int
    grpc_port: int
    model: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    scheme: str = "http"  # https with --ssl-certfile

    @property
    def http_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.http_url}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_server(
    log_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    ssl_context: ssl.SSLContext | None = None,
) -> ServerProcess:
    """`kvrelay serve ARGS` on free ports; returns once it serves (or fails with its log).
    With `ssl_context` (a server started with --ssl-certfile) /health is polled over https
    with that context: it trusts the test CA and, for mTLS, presents a client certificate."""
    http_port, grpc_port = free_port(), free_port()
    log_path = log_dir / f"kvrelay-serve-{http_port}.log"
    command = [
        sys.executable,
        "-m",
        "kvrelay.cli",
        "serve",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        *args,
    ]
    full_env = {**os.environ, **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, text=True, env=full_env
        )
    server = ServerProcess(process, http_port, grpc_port, "SmolLM2-135M-Instruct", log_path)
    if ssl_context is not None:
        server.scheme = "https"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvrelay serve exited with {process.returncode}:\n{server.log()}")
        try:
            url = f"{server.http_url}/health"
            with urllib.request.urlopen(url, timeout=2, context=ssl_context) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"kvrelay serve did not become healthy in {timeout_s} s:\n{server.log()}")


# Ray 2.60 turns token authentication on by default; a cluster started by `ray start` keeps
# its token where a separate driver process here does not look, so both run without it.
RAY_NO_AUTH_ENV = {
    **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    "RAY_AUTH_MODE": "disabled",
}


def start_ray_head(
    port: int,
    temp_dir: str,
    num_cpus: int,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
    client_port: int | None = None,
) -> subprocess.Popen[bytes]:
    """`ray start --head --block` on `port` in its own session (kill its process group to
    stop GCS, raylet and workers together); `temp_dir` must be short (Ray's socket paths).
    `client_port`: the Ray client server's (ray://), default a free one."""
    ray = Path(sys.executable).parent / "ray"
    return subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--num-cpus={num_cpus}",
            *extra,
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            f"--ray-client-server-port={client_port or free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
