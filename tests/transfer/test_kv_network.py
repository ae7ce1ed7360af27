"""Where the gRPC KV server listens and what it tells peers (issue 16, defect 2): with
$KVRELAY_KV_HOST set (a pod's IP) it binds that address and advertises exactly it; loopback
stays the default; a wildcard bind is never advertised. Real servers on two loopback addresses
(127.0.0.1 and 127.0.0.2, both local on Linux) stand in for two pods."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest
import torch

from kvrelay.transfer.base import KVConnector, TransferError
from kvrelay.transfer.factory import create_connector
from kvrelay.transfer.grpc_connector import GrpcConnector
from kvrelay.transfer.network import KVNetwork, is_wildcard
from tests.transfer.peers import make_kv
from tests.transfer.plans import SECRET, Leases, after_pull, plan_for

POD_A, POD_B = "127.0.0.1", "127.0.0.2"


@pytest.fixture
def closing() -> Iterator[Callable[[KVConnector], KVConnector]]:
    opened: list[KVConnector] = []
    yield lambda connector: opened.append(connector) or connector  # type: ignore[func-returns-value]
    for connector in reversed(opened):
        connector.close()


def serving(
    env: dict[str, str], engine_id: str, seed: int
) -> tuple[KVConnector, Leases, torch.Tensor]:
    """A prefill worker's connector as worker/actor.py builds it from its environment."""
    connector = create_connector("grpc", secret=SECRET, network=KVNetwork.from_env(env), serve=True)
    kv, leases = make_kv(seed), Leases()
    connector.register(kv, engine_id, 1)
    connector.authorize_pulls(leases.claim)
    return connector, leases, kv


def host_port(connector: KVConnector) -> tuple[str, int]:
    host, _, port = connector.metadata().payload.decode().rpartition(":")
    return host, int(port)


def listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def test_each_worker_advertises_the_address_it_bound(closing: Callable[..., KVConnector]) -> None:
    a, a_leases, a_kv = serving({"KVRELAY_KV_HOST": POD_A}, "PA", 1)
    b, b_leases, b_kv = serving({"KVRELAY_KV_HOST": POD_B}, "PB", 2)
    closing(a), closing(b)
    (a_host, a_port), (b_host, b_port) = host_port(a), host_port(b)
    assert (a_host, b_host) == (POD_A, POD_B)
    # Bound there and only there: the other address has nothing on that port.
    assert listening(POD_B, b_port) and not listening(POD_A, b_port)
    assert listening(POD_A, a_port) and not listening(POD_B, a_port)

    # A decode worker told these addresses pulls the right bytes from each.
    decode = closing(
        create_connector("grpc", secret=SECRET, network=KVNetwork.from_env({}), serve=False)
    )
    dst = make_kv(None)
    decode.register(dst, "D", 1)
    decode.add_peer(a.metadata())
    decode.add_peer(b.metadata())
    remote, local = (2, 3, 4), (0, 1, 2)
    before = dst.clone()
    decode.pull(b_leases.handle("PB", 1, remote, "D"), plan_for(remote, local))
    assert torch.equal(dst, after_pull(before, b_kv, remote, local))
    remote, local = (7, 1), (5, 9)
    before = dst.clone()
    decode.pull(a_leases.handle("PA", 1, remote, "D"), plan_for(remote, local))
    assert torch.equal(dst, after_pull(before, a_kv, remote, local))


def test_loopback_is_the_default(closing: Callable[..., KVConnector]) -> None:
    assert KVNetwork.from_env({}).host == POD_A
    connector, _, _ = serving({}, "P", 1)
    closing(connector)
    assert host_port(connector)[0] == POD_A


def test_a_wildcard_bind_is_never_advertised(closing: Callable[..., KVConnector]) -> None:
    """Before, KVRELAY_KV_HOST=0.0.0.0 told peers to dial 0.0.0.0:port, which each peer
    reaches as its own loopback: every cross-pod pull failed and recomputed."""
    for wildcard in ("0.0.0.0", "::", "[::]"):
        assert is_wildcard(wildcard)
        with pytest.raises(ValueError, match="KVRELAY_KV_ADVERTISE_HOST"):
            KVNetwork.from_env({"KVRELAY_KV_HOST": wildcard})
    with pytest.raises(ValueError, match="KVRELAY_KV_HOST"):
        KVNetwork(host=POD_A, advertise_host="0.0.0.0")
    # With an advertised address it binds every interface and tells peers that one.
    env = {"KVRELAY_KV_HOST": "0.0.0.0", "KVRELAY_KV_ADVERTISE_HOST": POD_B}
    connector, _, _ = serving(env, "P", 1)
    closing(connector)
    host, port = host_port(connector)
    assert host == POD_B and listening(POD_B, port) and listening(POD_A, port)


def test_a_host_name_is_advertised_as_is() -> None:
    """A name (a Service, or the name a TLS certificate was issued for) is the puller's to
    resolve, so it survives a pod's IP changing under it."""
    network = KVNetwork.from_env({"KVRELAY_KV_HOST": "localhost"})
    assert (network.host, network.peer_host) == ("localhost", "localhost")
    assert not is_wildcard("localhost") and not is_wildcard("10.0.0.7")


def test_a_pull_from_an_address_nobody_serves_names_the_peer_and_address(
    closing: Callable[..., KVConnector],
) -> None:
    """What a decode worker logs at WARNING when it falls back to recompute (engine_loop)."""
    prefill, leases, _ = serving({"KVRELAY_KV_HOST": POD_B}, "PB", 1)
    closing(prefill)
    _, port = host_port(prefill)
    meta = prefill.metadata()
    wrong = type(meta)(meta.engine_id, meta.epoch, meta.backend, f"{POD_A}:{port}".encode())
    decode = closing(
        create_connector(
            "grpc", secret=SECRET, network=KVNetwork.from_env({}), serve=False, timeout_s=5.0
        )
    )
    decode.register(make_kv(None), "D", 1)
    decode.add_peer(wrong)
    with pytest.raises(TransferError, match=rf"from PB at {POD_A}:{port}: UNAVAILABLE"):
        decode.pull(leases.handle("PB", 1, (1,), "D"), plan_for((1,), (0,)))


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_connector_built_by_hand_never_advertises_a_wildcard(host: str) -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        GrpcConnector(host=host)
    connector = GrpcConnector(host=host, advertise_host="127.0.0.1", serve=False)
    assert connector.advertise_host == "127.0.0.1"
    connector.close()
    GrpcConnector(host=host, serve=False).close()  # a puller only serves nothing: no address
