"""What the soak benchmarks' clients saw: outcomes counted by kind, inter-token gaps, and the
rule that tells a server-side failure (5xx, gRPC UNKNOWN/INTERNAL, a broken stream) from a
refusal the client earned."""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
# Server-side failures: any of them fails a soak.
GRPC_FAILURES = {"UNKNOWN", "INTERNAL"}


@dataclass
class Stats:
    """What every client saw, shared by the threads (appends and Counter updates under a lock)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    gaps_s: dict[str, list[float]] = field(default_factory=lambda: {"clean": [], "hostile": []})
    victim_runs: list[list[str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # first few server-side failures
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if is_failure(outcome) and len(self.failures) < 10:
                self.failures.append(f"{outcome}: {detail[:300]}")


def is_failure(outcome: str) -> bool:
    kind, _, code = outcome.partition(" ")
    return (
        (kind == "HTTP" and code.isdigit() and int(code) >= 500)
        or (kind == "gRPC" and code in GRPC_FAILURES)
        or outcome.startswith("broken")
    )


def stream_text(
    client: httpx.Client, url: str, payload: dict[str, Any], stats: Stats
) -> tuple[list[str], list[float]] | None:
    """A streamed completion's text pieces and inter-token gaps; None when it was refused or
    broken (counted either way)."""
    pieces: list[str] = []
    arrivals: list[float] = []
    try:
        with client.stream("POST", url + COMPLETIONS, json=payload, timeout=300) as reply:
            if reply.status_code != 200:
                stats.count(f"HTTP {reply.status_code}", reply.read().decode(errors="replace"))
                return None
            for line in reply.iter_lines():
                data = line[len("data:") :].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    stats.count("broken stream (error event)", data)
                    return None
                arrivals.append(time.monotonic())
                pieces.extend(c["text"] for c in chunk["choices"] if c["text"])
    except httpx.HTTPError as exc:
        stats.count("broken connection (HTTP)", repr(exc))
        return None
    stats.count("HTTP 200")
    return pieces, [b - a for a, b in itertools.pairwise(arrivals)]
