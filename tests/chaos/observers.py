"""What the chaos test watches from outside a real `kvrelay serve`: greedy streams (each token
with its arrival time), both health services probed in a background thread, the workers' pids
from the router's log, and the pool gauges on /metrics. Nothing here changes the server."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

GRPC_SERVICES = ("", "kvrelay.v1.Generation")
# "worker ID (ROLE, pid N[, pod P, revision G]) joined" (router/workers.py's WARNING)
JOINED = re.compile(r"worker (?P<id>\w+) \((?P<role>\w+), pid (?P<pid>\d+)[^)]*\) joined")
# What a client must never be told: Ray's words, process ids, addresses, tracebacks.
INTERNALS = re.compile(
    r"\bray\b|actor|\bpid\b|traceback|\b\d{1,3}(\.\d{1,3}){3}\b|[0-9a-f]{32}", re.IGNORECASE
)


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1
) -> Any:
    """Poll `predicate` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(every_s)


@dataclass
class Worker:
    engine_id: str
    role: str
    pid: int
    seen_at: float  # monotonic time the test first read its "joined" line


class WorkerLog:
    """The router's `worker <id> (<role>, pid <pid>) joined` lines, in order, each with the time
    the test first saw it: a thread reads the log every 0.1 s (the lines carry no timestamps)."""

    def __init__(self, read: Callable[[], str], every_s: float = 0.1) -> None:
        self._read = read
        self._every_s = every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-log", daemon=True)
        self.workers: list[Worker] = []

    def __enter__(self) -> WorkerLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.refresh()

    def refresh(self) -> list[Worker]:
        with self._lock:
            matches = list(JOINED.finditer(self._read()))
            now = time.monotonic()
            for match in matches[len(self.workers) :]:
                self.workers.append(Worker(match["id"], match["role"], int(match["pid"]), now))
            return list(self.workers)

    def current(self, role: str) -> Worker | None:
        joined = [w for w in self.refresh() if w.role == role]
        return joined[-1] if joined else None

    def replacement(self, role: str, dead_pid: int) -> Worker | None:
        """The worker of `role` that joined after the one with `dead_pid`, if one has."""
        worker = self.current(role)
        return worker if worker is not None and worker.pid != dead_pid else None


@dataclass
class Probe:
    service: str  # "http" or the gRPC service name ("" is the server)
    start: float
    end: float
    ready: bool | None  # None: the probe itself failed (no answer)
    detail: str = ""


class HealthProber:
    """Probes HTTP /health and gRPC health (both service names) every `every_s` in a thread."""

    def __init__(self, http_url: str, grpc_target: str, every_s: float = 0.1) -> None:
        self.probes: list[Probe] = []
        self._http_url = http_url
        self._grpc_target = grpc_target
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-prober", daemon=True)

    def __enter__(self) -> HealthProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client, grpc.insecure_channel(self._grpc_target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                self.probes.append(self._http(client))
                self.probes.extend(self._grpc(stub, name) for name in GRPC_SERVICES)
                self._stop.wait(self._every_s)

    def _http(self, client: httpx.Client) -> Probe:
        start = time.monotonic()
        try:
            status = client.get(f"{self._http_url}/health").status_code
        except httpx.HTTPError as exc:
            return Probe("http", start, time.monotonic(), None, repr(exc))
        ready = {200: True, 503: False}.get(status)
        return Probe("http", start, time.monotonic(), ready, f"HTTP {status}")

    def _grpc(self, stub: Any, name: str) -> Probe:
        start = time.monotonic()
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2.0)
        except grpc.RpcError as exc:
            return Probe(name, start, time.monotonic(), None, str(exc.code()))
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        ready = {"SERVING": True, "NOT_SERVING": False}.get(status)
        return Probe(name, start, time.monotonic(), ready, status)

    def of(self, service: str) -> list[Probe]:
        return [p for p in list(self.probes) if p.service == service]


@dataclass
class Stream:
    """One streamed greedy completion, read in its own thread: every token (a chunk's text, or
    the tokens its logprobs name) with its arrival time, text offsets (with logprobs), the
    finish reason, and the errors it got."""

    payload: dict[str, Any]
    tokens: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self, url: str) -> Stream:
        threading.Thread(target=self._read, args=(url,), daemon=True).start()
        return self

    def _read(self, url: str) -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10.0, read=180.0)) as client,
                client.stream("POST", f"{url}/v1/completions", json=self.payload) as reply,
            ):
                if reply.status_code != 200:
                    self.errors.append(f"HTTP {reply.status_code}: {reply.read().decode()}")
                    return
                for line in reply.iter_lines():
                    self._take(line)
        except httpx.HTTPError as exc:
            self.errors.append(f"connection: {exc!r}")
        finally:
            self.done.set()

    def _take(self, line: str) -> None:
        data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if not data or data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.errors.append(json.dumps(chunk["error"]))
            return
        now = time.monotonic()
        for choice in chunk["choices"]:
            # One chunk per token; with logprobs asked for, the chunk names its tokens.
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens") or [choice["text"]]
            self.tokens.extend(tokens)
            self.offsets.extend(logprobs.get("text_offset") or [])
            self.arrivals.extend(now for _ in tokens)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


def completion_payload(prompt: str, max_tokens: int, logprobs: bool = False) -> dict[str, Any]:
    """A greedy streamed completion of exactly `max_tokens` tokens (each named in logprobs
    when `logprobs`)."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "ignore_eos": True}  # fmt: skip
    return payload | ({"logprobs": 0} if logprobs else {})


def gauges(metrics_text: str, name: str) -> dict[str, float]:
    """A per-pool gauge from Prometheus text: pool -> value."""
    found = re.finditer(rf'^{name}\{{pool="(\w+)"\}} (\S+)$', metrics_text, re.MULTILINE)
    return {m.group(1): float(m.group(2)) for m in found}


def counter(metrics_text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}(?:\{{{wanted}\}})? (\S+)$", metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
