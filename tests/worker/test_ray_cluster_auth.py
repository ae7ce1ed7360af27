"""Joining a Ray cluster with token authentication (as the operator deploys every one): a real
`ray start --head` with RAY_AUTH_MODE=token; a process without the token, or with another,
is refused at once with an error that names the token, over the GCS address and over ray://;
with the token it joins."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port, start_ray_head

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "kvrelay-test-" + "ab" * 24
BASE_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))},
    "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "kernels", ".")),
}
CLUSTER_ENV = {**BASE_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
JOINER_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def head() -> Iterator[tuple[str, str]]:
    """A token-mode Ray head: its GCS address and its ray:// address, once both accept."""
    port, client_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")  # Ray's socket paths stay short
    process = start_ray_head(port, temp_dir, 1, CLUSTER_ENV, client_port=client_port)
    gcs, client = f"127.0.0.1:{port}", f"ray://127.0.0.1:{client_port}"
    try:
        _wait_joinable(gcs)
        yield gcs, client
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_joinable(address: str) -> None:
    deadline = time.monotonic() + 120
    while _join(address, CLUSTER_ENV, timeout_s=20)[0] != "joined":
        assert time.monotonic() < deadline, f"the Ray head at {address} never came up"
        time.sleep(2)


def _join(address: str, env: dict[str, str], timeout_s: float) -> tuple[str, str, float]:
    """join_ray_cluster(address) in a fresh process with `env`: (`joined` or the error's
    type, the error's text, seconds taken)."""
    script = textwrap.dedent(
        f"""
        import time
        start = time.monotonic()
        from kvrelay.worker.ray_cluster import join_ray_cluster
        try:
            join_ray_cluster({address!r}, "kvrelay-test", timeout_s={timeout_s})
            outcome, text = "joined", ""
        except Exception as error:
            outcome, text = type(error).__name__, str(error)
        print("RESULT", outcome, time.monotonic() - start, text, flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, out.stderr[-3000:]
    _, outcome, seconds, text = (results[-1] + " ").split(" ", 3)
    return outcome, text.strip(), float(seconds)


@pytest.mark.parametrize("kind", ["gcs", "ray-client"])
@pytest.mark.parametrize(
    "token_env",
    [{}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "another-token"}],
    ids=["no-token", "wrong-token"],
)
def test_without_the_token_the_join_is_refused_at_once(
    head: tuple[str, str], kind: str, token_env: dict[str, str]
) -> None:
    address = head[0] if kind == "gcs" else head[1]
    outcome, text, seconds = _join(address, {**BASE_ENV, **token_env}, JOINER_TIMEOUT_S)
    assert outcome == "RayTokenRefused", text
    # Ray's own ray.init would have waited the whole timeout and blamed the connection.
    assert seconds < 20, seconds
    assert address in text and "RAY_AUTH_TOKEN" in text and "<service>-ray-auth" in text


@pytest.mark.parametrize("kind", ["gcs", "ray-client"])
def test_with_the_token_the_join_succeeds(head: tuple[str, str], kind: str) -> None:
    address = head[0] if kind == "gcs" else head[1]
    outcome, text, _ = _join(address, CLUSTER_ENV, JOINER_TIMEOUT_S)
    assert outcome == "joined", text


def test_the_probe_leaves_unreachable_and_unparsed_addresses_to_ray() -> None:
    from kvrelay.worker.ray_cluster import token_refused

    assert token_refused("auto") is False
    assert token_refused(f"127.0.0.1:{free_port()}") is False  # nothing listens: not a refusal
