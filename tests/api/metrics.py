"""Reading a server's /metrics in tests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tests.servers import ServerProcess


@dataclass
class Scrape:
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        """The sample `name` with exactly these labels (0 when absent)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name` over the samples whose labels include these."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)


def scrape(server: ServerProcess) -> Scrape:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scrape(samples)


def wait_for(server: ServerProcess, ok: Callable[[Scrape], bool], timeout_s: float = 30) -> Scrape:
    """Scrape until `ok` holds (the router polls the workers' stats twice a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = scrape(server)
        if ok(current) or time.monotonic() > deadline:
            return current
        time.sleep(0.25)


def pools_idle(current: Scrape) -> bool:
    """Nothing running, waiting or leased at any pool, and every KV block free."""
    return (
        all(
            current.value(name, pool=pool) == 0
            for pool in ("prefill", "decode")
            for name in (
                "kvrelay_num_requests_running",
                "kvrelay_num_requests_waiting",
                "kvrelay_kv_cache_usage_ratio",
                "kvrelay_kv_leases",
            )
        )
        and current.value("kvrelay_pool_workers", pool="decode") == 1
    )
