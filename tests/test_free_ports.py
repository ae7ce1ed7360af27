"""The loopback ports the tests and the benchmarks start servers on come from outside the
ranges Ray binds in (its worker ports, and the kernel's ephemeral ports that Ray's raylet,
object manager and workers get for port 0), and are free when drawn."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

import tests.servers
from tests.benchmarks.scripts import load_script

SERVING = Path(__file__).parents[1] / "benchmarks" / "serving" / "servers.py"
RAY_WORKER_PORTS = range(10002, 20000)


def _ephemeral_ports() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


@pytest.fixture(params=["tests", "benchmarks"])
def free_port(request: pytest.FixtureRequest) -> Callable[[], int]:
    if request.param == "tests":
        return tests.servers.free_port
    return load_script(SERVING).free_port  # type: ignore[no-any-return]


def test_ports_are_free_and_outside_the_ranges_ray_binds_in(free_port: Callable[[], int]) -> None:
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # drawn at random: two concurrent callers rarely collide
    for port in ports:
        assert port not in RAY_WORKER_PORTS and port not in _ephemeral_ports()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_port_in_use_is_skipped(
    free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    idle = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken, taken, idle])
        monkeypatch.setattr(random, "choice", lambda _ports: next(draws))
        assert free_port() == idle


def test_no_free_port_is_an_error_that_says_so(
    free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setattr(random, "choice", lambda _ports: busy.getsockname()[1])
        with pytest.raises(RuntimeError, match="no free loopback port"):
            free_port()
