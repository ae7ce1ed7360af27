"""The Ray cluster `kvrelay serve` starts for itself (Pools.start without an address, with a
real prefill and decode worker) listens on loopback only, answers no HTTP on this host's other
addresses, and its GCS refuses a caller without the cluster's token (issue 41)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port
from tests.worker.conftest import TINY_ENGINE_KWARGS
from tests.worker.listeners import (
    Listener,
    describe,
    host_addresses,
    http_answers,
    off_loopback,
    tree_listeners,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    # alone: its own Ray head beside another worker's on two cores missed Ray's GCS connect
    # deadline (Makefile: RUN_SUITE).
    pytest.mark.alone,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc"),
]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
SERVE = textwrap.dedent(
    """
    import json, sys
    from kvrelay.worker.pools import Pools

    pools = Pools.start(sys.argv[1], engine_kwargs=json.loads(sys.argv[2]))
    print("ready", flush=True)
    sys.stdin.readline()  # until the test is done
    pools.shutdown()
    """
)


def _serve_env() -> dict[str, str]:
    """This environment (Ray's auth mode left as `kvrelay serve` gets it), not joining any
    cluster, with the repository importable. The autoscaler's metrics port is Ray's fixed
    44217 unless set: another Ray on this host (a test server, another checkout) may hold it,
    and this cluster's endpoint must be the one probed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["AUTOSCALER_METRIC_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(str(REPO / p) for p in ("services", "kernels", "."))
    return env


def _wait_ready(process: subprocess.Popen[str], log: Path) -> None:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
    line = process.stdout.readline() if ready else ""
    if line.strip() != "ready":
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the pools did not start: {line!r}\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def serve_process(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A process that started Ray and one prefill and one decode worker as `kvrelay serve`
    does (Pools.start with no address), held up until the module's tests are done; its pid."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(tiny_llama_dir), json.dumps(TINY_ENGINE_KWARGS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=_serve_env(),
            start_new_session=True,  # its process group: everything Ray started, to clean up
        )
    _wait_ready(process, log)
    yield process.pid
    try:
        process.communicate("stop\n", timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def listeners(serve_process: int) -> list[Listener]:
    found = tree_listeners(serve_process)
    commands = " ".join(listener.command for listener in found)
    # The listing must see Ray's own servers, or an empty list would pass.
    assert "gcs_server" in commands and "raylet" in commands, found
    assert len({listener.pid for listener in found}) >= 4, found  # driver, GCS, raylet, workers
    return found


def test_every_listener_is_on_loopback(listeners: list[Listener]) -> None:
    exposed = off_loopback(listeners)
    assert not exposed, f"{len(exposed)} listener(s) off loopback:\n{describe(exposed)}"


def test_no_listener_answers_http_on_this_hosts_other_addresses(
    listeners: list[Listener],
) -> None:
    """Every listener's port, tried on every non-loopback address of this host: none answers
    a request without credentials with a success (bound to loopback, none accepts at all)."""
    addresses = host_addresses()
    if not addresses:
        pytest.skip("this host has no address but loopback")
    answered = http_answers(listeners, addresses)
    assert not answered, "\n".join(answered)


def _gcs_get(port: int, token: str | None) -> object:
    """An InternalKV Get on the GCS at 127.0.0.1:`port`: its reply, or the gRPC status code."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gcs_service_pb2_grpc.InternalKVGcsServiceStub(channel)
        try:
            return stub.InternalKVGet(
                gcs_service_pb2.InternalKVGetRequest(key=b"kvrelay-probe"),  # type: ignore[attr-defined]
                metadata=metadata,
                timeout=10,
            )
        except grpc.RpcError as error:
            return error.code()


def _cluster_token() -> str:
    """The token a new local cluster uses: $RAY_AUTH_TOKEN, else the file Ray writes."""
    return os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").read_text()


def test_the_gcs_refuses_a_caller_without_the_token(listeners: list[Listener]) -> None:
    import grpc

    (port,) = {listener.port for listener in listeners if "gcs_server" in listener.command}
    assert _gcs_get(port, None) == grpc.StatusCode.UNAUTHENTICATED
    assert _gcs_get(port, "not-the-token") == grpc.StatusCode.UNAUTHENTICATED
    # The same call with the cluster's token goes through: the refusals were about the token.
    assert not isinstance(_gcs_get(port, _cluster_token().strip()), grpc.StatusCode)
