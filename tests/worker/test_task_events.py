"""Worker actors report no Ray task events (issue 41, flat memory): Ray's GCS keeps every actor
call's events, so a server's GCS grew with its requests. Measured on the session's real Ray: the
GCS's RSS over 2,000 calls to a worker actor, beside the same calls to a plain actor with Ray's
default (events on), which shows the measurement sees the growth."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvrelay.worker.pools import spawn_worker
from tests.transfer.plans import SECRET
from tests.worker.conftest import TINY_ENGINE_KWARGS

CALLS = 2000


def gcs_rss_mib() -> float:
    """The RSS of this Ray session's GCS server."""
    psutil = pytest.importorskip("psutil")
    import ray

    logs = str(Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs")
    for proc in psutil.process_iter(["name", "cmdline"]):
        if "gcs_server" in (proc.info["name"] or "") and any(
            logs in arg for arg in proc.info["cmdline"] or ()
        ):
            return float(proc.memory_info().rss) / 2**20
    pytest.skip("this Ray session's GCS server runs elsewhere")


def growth_over_calls(call: Any) -> float:
    """GCS RSS growth (MiB) over CALLS calls of `call()` (an ObjectRef each), in batches."""
    import ray

    ray.get(call())
    time.sleep(2)  # events of earlier calls flushed (every second)
    before = gcs_rss_mib()
    for _ in range(CALLS // 100):
        ray.get([call() for _ in range(100)])
    time.sleep(3)
    return gcs_rss_mib() - before


class Plain:
    def status(self) -> bool:
        return True


def test_worker_calls_leave_no_task_events_in_the_gcs(
    worker_ray: None, tiny_llama_dir: Path
) -> None:
    import ray

    args = {"model": str(tiny_llama_dir), **TINY_ENGINE_KWARGS}
    worker = spawn_worker(args, "both", "grpc", kv_secret=SECRET)
    plain = ray.remote(Plain).remote()
    try:
        with_events = growth_over_calls(lambda: plain.status.remote())
        without = growth_over_calls(lambda: worker.status.remote())
        assert with_events > 2.0, with_events  # Ray's default: ~4 KiB a call kept
        assert without < with_events / 4, (without, with_events)
    finally:
        ray.kill(worker)
        ray.kill(plain)
