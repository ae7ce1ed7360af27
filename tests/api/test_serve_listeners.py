"""Issue 41's target on a whole `kvrelay serve` with its defaults (router, both APIs, Ray, one
prefill and one decode worker): every listener of its process tree is on loopback, and none
answers HTTP without credentials on this host's other addresses."""

from __future__ import annotations

import sys

import pytest

from tests.servers import ServerProcess
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
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc"),
]


@pytest.fixture(scope="module")
def listeners(kvrelay_server: ServerProcess) -> list[Listener]:
    found = tree_listeners(kvrelay_server.process.pid)
    ports = {listener.port for listener in found}
    # The listing must see the router's own ports and Ray's servers, or an empty one passes.
    assert {kvrelay_server.http_port, kvrelay_server.grpc_port} <= ports, describe(found)
    commands = " ".join(listener.command for listener in found)
    assert "gcs_server" in commands and "raylet" in commands, describe(found)
    assert commands.count("ray::EngineWorker") >= 2, describe(found)
    return found


def test_every_listener_of_kvrelay_serve_is_on_loopback(listeners: list[Listener]) -> None:
    exposed = off_loopback(listeners)
    assert not exposed, f"{len(exposed)} listener(s) off loopback:\n{describe(exposed)}"


def test_no_listener_of_kvrelay_serve_answers_http_off_loopback(
    listeners: list[Listener],
) -> None:
    addresses = host_addresses()
    if not addresses:
        pytest.skip("this host has no address but loopback")
    answered = http_answers(listeners, addresses)
    assert not answered, "\n".join(answered)
