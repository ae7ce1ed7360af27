"""Joining a Ray cluster that is not up yet (as pods on Kubernetes start together): a real
`ray start --head` started after the joining process, and an address nothing listens on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.servers import RAY_NO_AUTH_ENV, free_port, start_ray_head

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RAY_ENV = {
    **RAY_NO_AUTH_ENV,
    "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "kernels", ".")),
}


def _joiner(address: str, timeout_s: float) -> subprocess.Popen[str]:
    """A process that joins `address` and prints `joined <node id>`, or the error's type and
    text."""
    script = textwrap.dedent(
        f"""
        import ray
        from kvrelay.worker.ray_cluster import join_ray_cluster
        try:
            join_ray_cluster({address!r}, "kvrelay-test", timeout_s={timeout_s})
        except Exception as error:
            print(type(error).__name__, error, flush=True)
        else:
            print("joined", ray.get_runtime_context().get_node_id(), flush=True)
            ray.shutdown()
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=RAY_ENV,
    )


def test_a_router_started_before_the_head_joins_it_once_it_is_up() -> None:
    port = free_port()
    joiner = _joiner(f"127.0.0.1:{port}", timeout_s=150)
    time.sleep(4)  # the joiner has found nothing at least once
    assert joiner.poll() is None, joiner.communicate()[0]
    temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")  # Ray's socket paths stay short
    head = start_ray_head(port, temp_dir, 1, RAY_ENV)
    try:
        output, _ = joiner.communicate(timeout=170)
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(60)
    assert "joined " in output, output
    assert "waiting for the Ray cluster at 127.0.0.1" in output  # it said what it waited for


def test_no_cluster_at_the_address_fails_with_what_to_check() -> None:
    address = f"127.0.0.1:{free_port()}"
    joiner = _joiner(address, timeout_s=5)
    output, _ = joiner.communicate(timeout=120)
    assert "RayClusterUnavailable" in output, output
    assert f"no Ray cluster could be joined at '{address}' in 5 s" in output
    assert "--ray-address" in output
