"""Real gRPC transfers: in process (server thread + client) and between two Ray actors; exact
bytes, stale epochs, out-of-range ids, a dead server. No mocks. (Who may pull what:
test_kv_security.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kvrelay.common.messages import PeerMetadata
from kvrelay.transfer.base import StalePeerError, TransferError
from kvrelay.transfer.grpc_connector import GrpcConnector
from tests.transfer.peers import make_kv
from tests.transfer.plans import PLANS, SECRET, Leases, after_pull, handle_for, plan_for

LocalPair = tuple[GrpcConnector, torch.Tensor, GrpcConnector, torch.Tensor, Leases]


@pytest.fixture
def local_pair() -> Iterator[LocalPair]:
    """Prefill "P" epoch 1 serving random blocks in 700-byte chunks (a 512-byte block spans
    two chunks) under its leases; decode "D" with zeros, not serving, that knows P."""
    server = GrpcConnector(chunk_bytes=700, secret=SECRET)
    client = GrpcConnector(serve=False, timeout_s=2.0, secret=SECRET)
    src, dst, leases = make_kv(0), make_kv(None), Leases()
    server.register(src, "P", 1)
    server.authorize_pulls(leases.claim)
    client.register(dst, "D", 1)
    client.add_peer(server.metadata())
    yield server, src, client, dst, leases
    client.close()
    server.close()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_in_process_pull_is_exact(name: str, local_pair: LocalPair) -> None:
    _, src, client, dst, leases = local_pair
    remote, local = PLANS[name]
    source, before = src.clone(), dst.clone()
    client.pull(leases.handle("P", 1, remote, "D"), plan_for(remote, local))
    assert torch.equal(dst, after_pull(before, source, remote, local))
    assert torch.equal(src, source)


def test_server_binds_loopback_on_an_ephemeral_port(local_pair: Any) -> None:
    server = local_pair[0]
    meta = server.metadata()
    host, port = meta.payload.decode().rsplit(":", 1)
    assert (meta.backend, meta.engine_id, meta.epoch) == ("grpc", "P", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_stale_and_unknown_epochs(local_pair: LocalPair) -> None:
    server, _, client, dst, leases = local_pair
    before = dst.clone()
    with pytest.raises(StalePeerError, match="unknown"):
        client.pull(handle_for("Q", 1, [0]), plan_for([0], [0]))
    # The client believes P is at epoch 2 (P restarted elsewhere); this server is epoch 1.
    client.add_peer(PeerMetadata("P", 2, "grpc", server.metadata().payload))
    with pytest.raises(StalePeerError, match="epoch 1"):
        client.pull(handle_for("P", 1, [0]), plan_for([0], [0]))
    with pytest.raises(StalePeerError, match="another life"):  # the server refuses it
        client.pull(leases.handle("P", 2, [0], "D"), plan_for([0], [0]))
    client.add_peer(server.metadata())  # epoch 1 now is older than 2: ignored
    with pytest.raises(StalePeerError):
        client.pull(handle_for("P", 1, [0]), plan_for([0], [0]))
    assert torch.equal(dst, before)


def test_out_of_range_ids_fail(local_pair: LocalPair) -> None:
    _, _, client, _, leases = local_pair
    # Even under a lease that names it, a block outside the tensor is never read.
    with pytest.raises(TransferError, match=r": not authorized \(the prefill worker"):
        client.pull(leases.handle("P", 1, [1, 16], "D"), plan_for([1, 16], [0, 1]))
    with pytest.raises(TransferError, match=r"local block ids \[16\]"):
        client.pull(leases.handle("P", 1, [1], "D"), plan_for([1], [16]))


def test_block_size_mismatch_fails(local_pair: LocalPair) -> None:
    server, leases = local_pair[0], local_pair[4]
    small = GrpcConnector(serve=False, timeout_s=2.0, secret=SECRET)
    small.register(torch.zeros(4, 1, 2, 4, 2, 8), "S", 1)
    small.add_peer(server.metadata())
    with pytest.raises(TransferError, match=r"INVALID_ARGUMENT.*one model, dtype and block size"):
        small.pull(leases.handle("P", 1, [0], "S"), plan_for([0], [0]))
    small.close()


def test_a_dead_server_fails_within_the_timeout() -> None:
    server = GrpcConnector(secret=SECRET)
    client = GrpcConnector(serve=False, timeout_s=1.0, secret=SECRET)
    server.register(make_kv(0), "P", 1)
    client.register(make_kv(None), "D", 1)
    client.add_peer(server.metadata())
    server.close()
    with pytest.raises(TransferError, match=r"UNAVAILABLE|timed out"):
        client.pull(handle_for("P", 1, [0]), plan_for([0], [0]))
    client.close()


def test_add_peer_refuses_bad_metadata() -> None:
    client = GrpcConnector(serve=False, secret=SECRET)
    client.register(make_kv(None), "D", 1)
    with pytest.raises(ValueError, match="'nixl' peer"):
        client.add_peer(PeerMetadata("P", 1, "nixl", b"x"))
    with pytest.raises(ValueError, match="host:port"):
        client.add_peer(PeerMetadata("P", 1, "grpc", b"nowhere"))
    with pytest.raises(RuntimeError, match="serve=True"):
        client.metadata()
    client.close()


def test_between_two_processes(actor_pair: tuple[Any, Any]) -> None:
    ray = pytest.importorskip("ray")
    prefill, decode = actor_pair
    meta = ray.get(prefill.start.remote("grpc", "GP", 4, 11))
    ray.get(decode.start.remote("grpc", "GD", 1, None, 2.0))
    ray.get(decode.add_peer.remote(meta))
    source = ray.get(prefill.kv_tensor.remote())
    for remote, local in PLANS.values():
        before = ray.get(decode.kv_tensor.remote())
        handle = ray.get(prefill.lease.remote(remote, "GD"))
        status = ray.get(decode.pull.remote(handle, plan_for(remote, local)))
        assert status[0] == "ok", status
        expected = after_pull(before, source, remote, local)
        assert torch.equal(ray.get(decode.kv_tensor.remote()), expected)
    stale = ray.get(decode.pull.remote(handle_for("GP", 3, [0], "x"), plan_for([0], [0])))
    assert stale[0] == "StalePeerError"


def test_concurrent_pulls_from_other_threads(local_pair: LocalPair) -> None:
    _, src, client, dst, leases = local_pair
    pairs = [([i], [15 - i]) for i in range(8)]

    def pull(pair: tuple[list[int], list[int]]) -> None:
        client.pull(leases.handle("P", 1, pair[0], "D"), plan_for(*pair))

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(pull, pairs))
    assert torch.equal(dst[8:].flip(0), src[:8])
    assert not dst[:8].any()
