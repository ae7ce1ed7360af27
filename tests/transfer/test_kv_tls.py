"""mTLS on the KV gRPC channel (issue 13). With $KVRELAY_KV_TLS_* set, a pull over mTLS is
byte-exact; a caller with no client certificate, one from another CA, an expired one, or no
TLS at all reads 0 bytes even holding a valid proof and handle; a puller refuses a server
whose certificate the CA did not sign, before sending it anything. Real servers and
certificates (a test CA from the `openssl` CLI), no mocks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import torch

from kvrelay.common.messages import KVHandle
from kvrelay.transfer.base import TransferError
from kvrelay.transfer.factory import create_connector
from kvrelay.transfer.grpc_connector import GrpcConnector
from kvrelay.transfer.kv_regions import block_bytes
from kvrelay.transfer.network import KVNetwork
from kvrelay.transfer.tls import KVTLS, KVTLSError
from kvrelay.v1 import kv_transfer_pb2 as pb
from kvrelay.v1 import kv_transfer_pb2_grpc as pb_grpc
from tests.pki import have_openssl, make_ca, make_expired, make_leaf
from tests.transfer.peers import make_kv
from tests.transfer.plans import PLANS, SECRET, Leases, after_pull, plan_for

BOTH = "serverAuth,clientAuth"  # a worker's certificate is its server and client identity
LOCAL = "IP:127.0.0.1,DNS:localhost"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca signs: worker (for 127.0.0.1), named (only for DNS:kvrelay-kv), expired (2020).
    other-ca signs impostor (for 127.0.0.1)."""
    if not have_openssl():
        pytest.skip("the openssl CLI makes the test certificates")
    folder = tmp_path_factory.mktemp("kv-pki")
    make_ca(folder, "ca")
    make_ca(folder, "other-ca")
    make_leaf(folder, "worker", "ca", BOTH, san=LOCAL)
    make_leaf(folder, "named", "ca", BOTH, san="DNS:kvrelay-kv")
    make_leaf(folder, "impostor", "other-ca", BOTH, san=LOCAL)
    make_expired(folder, "expired", "ca")
    return folder


def tls_of(pki: Path, who: str, ca: str = "ca", server_name: str | None = None) -> KVTLS:
    return KVTLS.from_files(pki / f"{who}.pem", pki / f"{who}.key", pki / f"{ca}.pem", server_name)


class Prefill:
    """A prefill worker "P" epoch 1 serving random blocks under its leases; counts how many
    pulls reached its lease table (a refused handshake never does)."""

    def __init__(self, tls: KVTLS | None) -> None:
        self.kv, self.leases, self.claims = make_kv(5), Leases(), 0
        self.connector = GrpcConnector(chunk_bytes=700, secret=SECRET, tls=tls)
        self.connector.register(self.kv, "P", 1)
        self.connector.authorize_pulls(self.claim)

    def claim(self, handle_id: str, requester: str, block_ids: Sequence[int]) -> bool:
        self.claims += 1
        return self.leases.claim(handle_id, requester, block_ids)

    @property
    def address(self) -> str:
        return self.connector.metadata().payload.decode()


def decode_of(prefill: Prefill, tls: KVTLS | None) -> tuple[GrpcConnector, torch.Tensor]:
    """Decode worker "D" (zeros, not serving) that knows `prefill`."""
    client, kv = GrpcConnector(serve=False, timeout_s=5.0, secret=SECRET, tls=tls), make_kv(None)
    client.register(kv, "D", 1)
    client.add_peer(prefill.connector.metadata())
    return client, kv


@pytest.fixture
def closing() -> Iterator[Callable[[GrpcConnector], GrpcConnector]]:
    """Closes every connector handed to it at the end of the test."""
    opened: list[GrpcConnector] = []

    def close_later(connector: GrpcConnector) -> GrpcConnector:
        opened.append(connector)
        return connector

    yield close_later
    for connector in reversed(opened):
        connector.close()


def test_a_pull_over_mtls_is_exact(pki: Path, closing: Callable[..., GrpcConnector]) -> None:
    prefill = Prefill(tls_of(pki, "worker"))
    closing(prefill.connector)
    client, dst = decode_of(prefill, tls_of(pki, "worker"))
    closing(client)
    source = prefill.kv.clone()
    for remote, local in PLANS.values():
        before = dst.clone()
        client.pull(prefill.leases.handle("P", 1, remote, "D"), plan_for(remote, local))
        assert torch.equal(dst, after_pull(before, source, remote, local))
    assert prefill.claims == len(PLANS)


def _raw_channel(pki: Path, address: str, who: str | None) -> grpc.Channel:
    """An outsider's channel: plaintext, or TLS trusting the CA with `who`'s certificate."""
    if who == "plaintext":
        return grpc.insecure_channel(address)
    if who is None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(_pem(pki, "ca")))
    creds = grpc.ssl_channel_credentials(
        _pem(pki, "ca"), (pki / f"{who}.key").read_bytes(), _pem(pki, who)
    )
    return grpc.secure_channel(address, creds)


def _pem(pki: Path, name: str) -> bytes:
    return (pki / f"{name}.pem").read_bytes()


def _valid_request(prefill: Prefill, handle: KVHandle) -> pb.PullBlocksRequest:
    """Everything a rightful pull carries: proof, handle, the engine it is bound to."""
    ids, size = list(handle.block_ids), block_bytes(prefill.kv)
    proof = SECRET.pull_proof("P", 1, handle.handle_id, "D", ids, size)
    return pb.PullBlocksRequest(
        engine_id="P", epoch=1, request_id="req", block_ids=ids, block_bytes=size,
        handle_id=handle.handle_id, requester_engine_id="D", proof=proof,
    )  # fmt: skip


@pytest.mark.parametrize("who", [None, "impostor", "expired", "plaintext"])
def test_without_a_good_client_certificate_nothing_is_read(
    pki: Path, who: str | None, closing: Callable[..., GrpcConnector]
) -> None:
    prefill = Prefill(tls_of(pki, "worker"))
    closing(prefill.connector)
    handle = prefill.leases.handle("P", 1, [2, 3, 4], "D")
    received = 0
    with _raw_channel(pki, prefill.address, who) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            for chunk in stub.PullBlocks(_valid_request(prefill, handle), timeout=5.0):
                received += len(chunk.data)
    assert received == 0
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert prefill.claims == 0  # refused at the handshake: the servicer never saw it
    # The handle was not spent: the rightful decode worker, over mTLS, still pulls it.
    client, dst = decode_of(prefill, tls_of(pki, "worker"))
    closing(client)
    client.pull(handle, plan_for([2, 3, 4], [0, 1, 2]))
    assert torch.equal(dst[:3], prefill.kv[2:5])


def test_a_server_outside_the_ca_is_refused_by_the_puller(
    pki: Path, closing: Callable[..., GrpcConnector]
) -> None:
    # It would accept our client certificate (it trusts our CA), but its own is another CA's.
    impostor = Prefill(tls_of(pki, "impostor", ca="ca"))
    closing(impostor.connector)
    client, dst = decode_of(impostor, tls_of(pki, "worker"))
    closing(client)
    with pytest.raises(TransferError, match=r"UNAVAILABLE.*CERTIFICATE_VERIFY_FAILED"):
        client.pull(impostor.leases.handle("P", 1, [1, 2], "D"), plan_for([1, 2], [0, 1]))
    assert not dst.any()
    assert impostor.claims == 0  # the request (proof, handle) never reached it


def test_the_server_name_is_checked_and_can_be_overridden(
    pki: Path, closing: Callable[..., GrpcConnector]
) -> None:
    """A pool sharing one certificate for "kvrelay-kv" (not for the pod IPs peers dial)."""
    prefill = Prefill(tls_of(pki, "named"))
    closing(prefill.connector)
    unnamed, _ = decode_of(prefill, tls_of(pki, "worker"))
    closing(unnamed)
    # grpcio >= 1.85 says "Hostname Verification"; older ones "... is not in peer certificate".
    mismatch = r"(Hostname Verification|not in peer certificate).*KV_TLS_SERVER_NAME"
    with pytest.raises(TransferError, match=mismatch):
        unnamed.pull(prefill.leases.handle("P", 1, [1], "D"), plan_for([1], [0]))
    assert prefill.claims == 0
    named, dst = decode_of(prefill, tls_of(pki, "worker", server_name="kvrelay-kv"))
    closing(named)
    named.pull(prefill.leases.handle("P", 1, [6, 7], "D"), plan_for([6, 7], [3, 4]))
    assert torch.equal(dst[3:5], prefill.kv[6:8])


def _env(pki: Path, **extra: str) -> dict[str, str]:
    return {
        "KVRELAY_KV_TLS_CERT": str(pki / "worker.pem"),
        "KVRELAY_KV_TLS_KEY": str(pki / "worker.key"),
        "KVRELAY_KV_TLS_CA": str(pki / "ca.pem"),
        **extra,
    }


def test_workers_configured_from_the_environment_pull_over_mtls(
    pki: Path, closing: Callable[..., GrpcConnector]
) -> None:
    """What a worker does (worker/actor.py): KVNetwork.from_env() -> create_connector."""
    network = KVNetwork.from_env(_env(pki))
    assert network.tls == tls_of(pki, "worker")
    assert "PRIVATE" not in repr(network)  # no key material in logs
    server = closing(create_connector("auto", secret=SECRET, network=network))
    client = closing(create_connector("auto", secret=SECRET, network=network, serve=False))
    assert isinstance(server, GrpcConnector) and isinstance(client, GrpcConnector)
    src, dst, leases = make_kv(9), make_kv(None), Leases()
    server.register(src, "P", 1)
    server.authorize_pulls(leases.claim)
    client.register(dst, "D", 1)
    client.add_peer(server.metadata())
    client.pull(leases.handle("P", 1, [0, 5], "D"), plan_for([0, 5], [1, 2]))
    assert torch.equal(dst[1:3], src[[0, 5]])
    with pytest.raises(ValueError, match="nixl, which has no TLS"):
        create_connector("nixl", secret=SECRET, network=network)


def test_tls_settings_from_the_environment(pki: Path, tmp_path: Path) -> None:
    assert KVTLS.from_env({}) is None
    assert KVNetwork.from_env({}).tls is None  # unchanged default: plaintext on loopback
    env = _env(pki, KVRELAY_KV_TLS_SERVER_NAME="kvrelay-kv")
    assert KVTLS.from_env(env) == tls_of(pki, "worker", server_name="kvrelay-kv")
    partial = _env(pki)
    del partial["KVRELAY_KV_TLS_KEY"], partial["KVRELAY_KV_TLS_CA"]
    with pytest.raises(KVTLSError, match=r"missing: \$KVRELAY_KV_TLS_KEY, \$KVRELAY_KV_TLS_CA"):
        KVNetwork.from_env(partial)
    with pytest.raises(KVTLSError, match="SERVER_NAME is set but KV TLS is off"):
        KVTLS.from_env({"KVRELAY_KV_TLS_SERVER_NAME": "kvrelay-kv"})
    gone = str(tmp_path / "gone.pem")
    with pytest.raises(KVTLSError, match=rf"cannot read {gone} \(\$KVRELAY_KV_TLS_CA\)"):
        KVTLS.from_env(_env(pki, KVRELAY_KV_TLS_CA=gone))
    (tmp_path / "empty.pem").write_text("\n")
    with pytest.raises(KVTLSError, match=r"\(\$KVRELAY_KV_TLS_CERT\) holds no PEM"):
        KVTLS.from_env(_env(pki, KVRELAY_KV_TLS_CERT=str(tmp_path / "empty.pem")))
