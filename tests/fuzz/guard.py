"""What hostile traffic must not touch, watched from background threads while it runs: a
victim greedy stream, run over and over (its tokens must equal a run without the traffic),
and a /health poller (every answer within 1 s).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx

from kvrelay.v1 import generation_pb2 as pb
from tests.fuzz.wire import stream_events

VICTIM_PROMPT = "The capital of France is Paris. The capital of Italy is"
VICTIM_TOKENS = 24
HEALTH_LIMIT_S = 1.0


@dataclass
class VictimRun:
    tokens: list[str | int]  # HTTP: the text pieces; gRPC: the token ids
    gaps_s: list[float]  # between consecutive token arrivals
    error: str | None = None  # why the stream did not finish normally


def http_victim(url: str, max_tokens: int = VICTIM_TOKENS) -> VictimRun:
    """One greedy streamed completion (ignore_eos: always `max_tokens` tokens)."""
    payload = {
        "prompt": VICTIM_PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    pieces: list[str | int] = []
    arrivals: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=120) as reply:
        if reply.status_code != 200:
            return VictimRun([], [], f"HTTP {reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            for event in stream_events(line.encode()):
                if event == "[DONE]":
                    return VictimRun(pieces, _gaps(arrivals))
                chunk = json.loads(event)
                if "error" in chunk:
                    return VictimRun(pieces, _gaps(arrivals), f"error event: {event}")
                arrivals.append(time.monotonic())
                pieces.extend(c["text"] for c in chunk["choices"] if c["text"])
    return VictimRun(pieces, _gaps(arrivals), "the stream ended without [DONE]")


def grpc_victim(target: str) -> VictimRun:
    """One greedy streamed Generate; the token ids are compared, not the text."""
    request = pb.GenerateRequest(
        prompt=VICTIM_PROMPT,
        stream=True,
        sampling=pb.SamplingOptions(temperature=0, max_tokens=VICTIM_TOKENS, ignore_eos=True),
    )
    ids: list[str | int] = []
    arrivals: list[float] = []
    with grpc.insecure_channel(target) as channel:
        stub = channel.unary_stream(
            "/kvrelay.v1.Generation/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        try:
            for response in stub(request, timeout=120):
                for choice in response.choices:
                    if choice.token_ids:
                        arrivals.append(time.monotonic())
                        ids.extend(choice.token_ids)
                    if choice.finish_reason == pb.FINISH_REASON_ABORT:
                        return VictimRun(ids, _gaps(arrivals), "aborted")
        except grpc.RpcError as exc:
            return VictimRun(ids, _gaps(arrivals), f"{exc.code().name}: {exc.details()}")
    return VictimRun(ids, _gaps(arrivals))


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals)]


def _overloaded(run: VictimRun) -> bool:
    """Refused for overload (429 / RESOURCE_EXHAUSTED) before any token: retry, not a harm."""
    return (
        run.error is not None
        and not run.tokens
        and (run.error.startswith("HTTP 429") or run.error.startswith("RESOURCE_EXHAUSTED"))
    )


@dataclass
class Guard:
    """`with Guard(victim, health_url) as guard:` runs the victim and the poller until exit."""

    victim: Callable[[], VictimRun]
    health_url: str
    baseline: VictimRun = field(init=False)
    runs: list[VictimRun] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Guard:
        self.baseline = self.victim()  # before any hostile traffic
        assert self.baseline.error is None and len(self.baseline.tokens) > 0, self.baseline
        self._threads = [
            threading.Thread(target=self._victims, daemon=True),
            threading.Thread(target=self._health, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _victims(self) -> None:
        while not self._stop.is_set():
            try:
                run = self.victim()
            except (httpx.HTTPError, grpc.RpcError) as exc:  # a broken connection is harm too
                run = VictimRun([], [], repr(exc))
            if _overloaded(run):
                time.sleep(0.2)
                continue
            self.runs.append(run)

    def _health(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status: int | str = httpx.get(self.health_url, timeout=10).status_code
            except httpx.HTTPError as exc:
                status = repr(exc)
            self.health_s.append(time.monotonic() - started)
            if status != 200:
                self.health_failures.append(f"/health: {status}")
            self._stop.wait(0.2)

    def check(self) -> None:
        """Every victim run finished with the baseline's tokens; /health always answered 200
        within HEALTH_LIMIT_S. Call after exit."""
        assert self.runs, "no victim run completed while the traffic ran"
        bad = [r for r in self.runs if r.error is not None or r.tokens != self.baseline.tokens]
        assert not bad, (
            f"{len(bad)} of {len(self.runs)} victim runs differ from the baseline "
            f"{self.baseline.tokens}; first: {bad[0]}"
        )
        assert not self.health_failures, self.health_failures[:5]
        slowest = max(self.health_s, default=0.0)
        assert slowest < HEALTH_LIMIT_S, f"/health took {slowest:.2f} s"
