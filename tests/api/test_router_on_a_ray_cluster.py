"""The multi-node entry points as Kubernetes runs them: a Ray head started by `ray start` that
offers the `kvrelay_prefill` / `kvrelay_decode` resources (as KubeRay worker pods do), and
`kvrelay router --manage-workers` joining it, starting one worker per resource unit and
serving requests through them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import RAY_NO_AUTH_ENV, free_port, start_ray_head

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


RAY_ENV = {
    **RAY_NO_AUTH_ENV,
    # The deployment's KV secret in every node's environment, as a Kubernetes Secret puts it:
    # workers the router starts on the cluster read it there.
    "KVRELAY_KV_SECRET": "kvrelay-test-cluster-kv-secret-0123456789",
}


@pytest.fixture
def ray_head() -> Iterator[str]:
    # A short temp dir: Ray's unix socket paths must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    port = free_port()
    resources = json.dumps({"kvrelay_prefill": 1, "kvrelay_decode": 1})
    head = start_ray_head(port, temp_dir, 2, RAY_ENV, (f"--resources={resources}",))
    time.sleep(8)  # GCS and raylet up
    assert head.poll() is None, "ray start --head failed"
    yield f"127.0.0.1:{port}"
    os.killpg(head.pid, signal.SIGKILL)  # its own session: GCS, raylet and workers go too
    head.wait(60)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_router_manages_workers_on_the_cluster(
    ray_head: str, tmp_path: Path, default_model_dir: Path
) -> None:
    http_port = free_port()
    log = (tmp_path / "router.log").open("w")
    env = RAY_ENV
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvrelay.cli",
            "router",
            "--ray-address",
            ray_head,
            "--manage-workers",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(free_port()),
            "--max-local-prefill-tokens",
            "4",
            "--kv-cache-memory",
            "128MiB",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 180
        healthy = False
        while time.monotonic() < deadline and not healthy:
            assert router.poll() is None, (tmp_path / "router.log").read_text()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    healthy = response.status == 200
            except OSError:
                time.sleep(1)
        assert healthy, (tmp_path / "router.log").read_text()
        # The decode worker joins first sometimes: wait for the prefill pool too.
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
                text = response.read().decode()
            if 'kvrelay_pool_workers{pool="prefill"} 1.0' in text:
                break
            time.sleep(1)
        assert 'kvrelay_pool_workers{pool="decode"} 1.0' in text
        assert 'kvrelay_pool_workers{pool="prefill"} 1.0' in text
        body = json.dumps(
            {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        assert reply["choices"][0]["text"].startswith(" Paris")
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert 'kvrelay_disaggregation_decisions_total{decision="disaggregated"} 1.0' in text
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(60)
        log.close()
