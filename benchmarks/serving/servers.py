"""Start and stop the servers that serve_compare.py measures, each on free loopback ports.

Each server runs in its own session (process group) so that stopping it also stops the
workers it spawned; its output goes to a log file that is shown when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx


def free_port() -> int:
    """A loopback port that was free a moment ago (the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    base_url: str
    ready_path: str  # GET returns 200 once the server can take requests
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request


def kvrelay_spec(
    name: str,
    kvrelay_bin: str,
    colocated: bool,
    model: str | None,
    extra_args: tuple[str, ...] = (),
) -> ServerSpec:
    """`kvrelay serve` on free loopback ports; `extra_args` go on its command line as given."""
    http_port, grpc_port = free_port(), free_port()
    command = [kvrelay_bin, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    command += (["--model", model] if model else []) + (["--colocated"] if colocated else [])
    command += list(extra_args)
    return ServerSpec(name, command, f"http://127.0.0.1:{http_port}", "/health")


def llama_cpp_spec(python: str, gguf: Path, threads: int, eos_ids: list[int]) -> ServerSpec:
    port = free_port()
    command = [python, "-m", "llama_cpp.server", "--model", str(gguf)]
    command += ["--n_threads", str(threads), "--host", "127.0.0.1", "--port", str(port)]
    # By default a new request interrupts the one being streamed; queue them instead, as a
    # serving engine does.
    command += ["--interrupt_requests", "False"]
    # llama.cpp's server knows neither ignore_eos nor min_tokens: forbidding the end-of-text
    # tokens keeps its outputs as long as the other servers'.
    bias = {str(i): -100.0 for i in eos_ids}
    return ServerSpec(
        "llama.cpp", command, f"http://127.0.0.1:{port}", "/v1/models", {"logit_bias": bias}
    )


def llama_server_spec(binary: str, gguf: Path, threads: int, parallel: int) -> ServerSpec:
    """llama.cpp's own C++ `llama-server` with `parallel` slots and continuous batching: the
    strongest llama.cpp peer (llama-cpp-python's server runs one request at a time)."""
    port = free_port()
    command = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    # -c is the context of all slots together: 1024 tokens each.
    command += ["-t", str(threads), "--parallel", str(parallel), "-c", str(1024 * parallel)]
    command += ["--cont-batching", "--no-webui"]
    return ServerSpec(
        "llama.cpp server", command, f"http://127.0.0.1:{port}", "/health", {"ignore_eos": True}
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
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

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
