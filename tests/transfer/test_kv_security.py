"""Who may read a worker's KV blocks (issue 13). An attacker process on the same host with no
credential or a wrong one, and a platform engine with the credential but another engine's,
a spent or an expired handle, all pull 0 bytes, over gRPC and over NIXL, and the answers tell
them nothing. The rightful decode engine still pulls. No mocks: real servers, real agents,
the attacker in its own process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from kvrelay.common.messages import KVHandle
from kvrelay.transfer.base import TransferError
from kvrelay.transfer.grpc_connector import GrpcConnector
from kvrelay.transfer.kv_regions import block_bytes
from kvrelay.transfer.kv_secret import NOT_AUTHORIZED, KVSecret, KVSecretError
from kvrelay.transfer.nixl_api import nixl_available
from kvrelay.v1 import kv_transfer_pb2 as pb
from kvrelay.v1 import kv_transfer_pb2_grpc as pb_grpc
from tests.transfer.peers import NUM_BLOCKS, make_kv
from tests.transfer.plans import SECRET, Leases, plan_for

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}  # IPv4 loopback on an IPv6 socket too


@dataclass
class Victim:
    """A prefill engine serving its leased blocks, the decode engine D1 it handed `handle`
    to, and D2: another engine of the deployment (it holds the secret)."""

    server: GrpcConnector
    kv: torch.Tensor
    leases: Leases
    handle: KVHandle  # blocks 2, 3, 4, bound to D1
    d1: GrpcConnector
    d1_kv: torch.Tensor
    d2: GrpcConnector
    d2_kv: torch.Tensor

    @property
    def address(self) -> str:
        return self.server.metadata().payload.decode()

    def secrets(self) -> list[str]:
        """What no refusal may tell: ids, epoch, block size and count, the handle."""
        h = self.handle
        size = block_bytes(self.kv)
        return [h.engine_id, str(h.epoch), str(size), str(NUM_BLOCKS), h.handle_id, "D1"]


@pytest.fixture
def victim() -> Iterator[Victim]:
    server = GrpcConnector(secret=SECRET)
    kv, leases = make_kv(21), Leases()
    engine_id, epoch = f"prefill-{os.urandom(4).hex()}", time.time_ns()
    server.register(kv, engine_id, epoch)
    server.authorize_pulls(leases.claim)
    decoders = []
    for name in ("D1", "D2"):
        client = GrpcConnector(serve=False, timeout_s=5.0, secret=SECRET)
        client_kv = make_kv(None)
        client.register(client_kv, name, 1)
        client.add_peer(server.metadata())
        decoders += [client, client_kv]
    handle = leases.handle(engine_id, epoch, [2, 3, 4], decode="D1")
    yield Victim(server, kv, leases, handle, *decoders)
    for connector in (decoders[0], decoders[2], server):
        connector.close()


def run_attacker(mode: str, spec: dict[str, object]) -> object:
    done = subprocess.run(
        [sys.executable, "-m", "tests.transfer.attacker", mode, json.dumps(spec)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_tells_nothing(details: str, victim: Victim) -> None:
    assert details == NOT_AUTHORIZED
    for secret in victim.secrets():
        assert secret not in details


def test_an_outsider_process_pulls_nothing_over_grpc(victim: Victim) -> None:
    h = victim.handle
    size = block_bytes(victim.kv)
    everything = list(range(NUM_BLOCKS))
    wrong = KVSecret(b"w" * 32).key.hex()
    attempts = [
        # The attack: a made-up engine id, then guesses from what the errors said.
        {"engine_id": "made-up", "epoch": 1, "block_ids": [0], "block_bytes": 1},
        {"engine_id": h.engine_id, "epoch": h.epoch, "block_ids": everything, "block_bytes": size},
        # Worst case: it overheard the handle and every id, but holds no credential...
        {
            "engine_id": h.engine_id,
            "epoch": h.epoch,
            "handle_id": h.handle_id,
            "requester_engine_id": "D1",
            "block_ids": [2, 3, 4],
            "block_bytes": size,
        },
        # ... or a wrong one.
        {
            "engine_id": h.engine_id,
            "epoch": h.epoch,
            "handle_id": h.handle_id,
            "requester_engine_id": "D1",
            "block_ids": [2, 3, 4],
            "block_bytes": size,
            "secret": wrong,
        },
    ]
    results = run_attacker("grpc", {"address": victim.address, "attempts": attempts})
    assert isinstance(results, list) and len(results) == len(attempts)
    for result in results:
        assert result["code"] == "PERMISSION_DENIED" and result["bytes"] == 0, result
        assert_tells_nothing(result["details"], victim)
    # None of that spent the handle: its decode engine still pulls it, exactly.
    victim.d1.pull(h, plan_for([2, 3, 4], [7, 8, 9]))
    assert torch.equal(victim.d1_kv[7:10], victim.kv[2:5])


def raw_pull(
    victim: Victim,
    requester: str,
    handle: KVHandle,
    secret: KVSecret,
    block_ids: list[int] | None = None,
) -> grpc.RpcError:
    """A PullBlocks of `block_ids` (default the handle's) signed with `secret` as engine
    `requester`; returns the refusal."""
    size = block_bytes(victim.kv)
    ids = list(handle.block_ids) if block_ids is None else block_ids
    request = pb.PullBlocksRequest(
        engine_id=handle.engine_id,
        epoch=handle.epoch,
        handle_id=handle.handle_id,
        requester_engine_id=requester,
        block_ids=ids,
        block_bytes=size,
        proof=secret.pull_proof(
            handle.engine_id, handle.epoch, handle.handle_id, requester, ids, size
        ),
    )
    with grpc.insecure_channel(victim.address) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullBlocks(request, timeout=5))
    return info.value


def test_a_valid_credential_pulls_only_its_own_handle_once(victim: Victim) -> None:
    h = victim.handle
    # D2 holds the secret, but the router gave this handle to D1.
    refused = raw_pull(victim, "D2", h, SECRET)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert_tells_nothing(refused.details() or "", victim)
    with pytest.raises(TransferError, match="not authorized"):
        victim.d2.pull(h, plan_for([2, 3, 4], [0, 1, 2]))
    assert not victim.d2_kv.any()
    # D1 pulls it once; the same handle again (or the identical request replayed) pulls nothing.
    victim.d1.pull(h, plan_for([2, 3, 4], [0, 1, 2]))
    assert torch.equal(victim.d1_kv[:3], victim.kv[2:5])
    with pytest.raises(TransferError, match="not authorized"):
        victim.d1.pull(h, plan_for([2, 3, 4], [5, 6, 7]))
    assert_tells_nothing(raw_pull(victim, "D1", h, SECRET).details() or "", victim)
    assert not victim.d1_kv[5:].any()


def test_expired_unknown_and_overreaching_handles_pull_nothing(victim: Victim) -> None:
    h = victim.handle
    short = victim.leases.handle(h.engine_id, h.epoch, [5], decode="D1", ttl_s=0.05)
    time.sleep(0.1)
    made_up = KVHandle(h.engine_id, h.epoch, "x", (2,), 4, (), 0, handle_id="guess")
    for handle, remote in ((short, [5]), (made_up, [2]), (h, [2, 3, 4, 5])):
        with pytest.raises(TransferError, match="not authorized"):
            victim.d1.pull(handle, plan_for(remote, list(range(len(remote)))))
        refused = raw_pull(victim, "D1", handle, SECRET, remote)
        assert_tells_nothing(refused.details() or "", victim)
    assert not victim.d1_kv.any()


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process `pid` (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (other threads run)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints the address as 32-bit little-endian words.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def test_the_grpc_kv_server_listens_on_loopback_only(victim: Victim) -> None:
    port = int(victim.address.rsplit(":", 1)[1])
    addresses = {ip for ip, p in tcp_listeners(os.getpid()) if p == port}
    assert addresses and addresses <= LOOPBACK, addresses


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_a_nixl_outsider_gets_no_metadata_and_reads_nothing() -> None:
    from kvrelay.transfer.nixl_connector import NixlConnector
    from kvrelay.v1.kv_transfer_pb2 import NixlPeerInfo

    before = tcp_listeners(os.getpid())
    victim = NixlConnector(timeout_s=2.0)
    kv = make_kv(33)
    victim.register(kv, "nixl-victim", 1)
    try:
        ucx = tcp_listeners(os.getpid()) - before
        assert ucx and {ip for ip, _ in ucx} <= LOOPBACK, ucx  # UCX: loopback only
        info = NixlPeerInfo.FromString(victim.metadata().payload)  # the attacker never gets it
        result = run_attacker(
            "nixl",
            {
                "agent_name": info.agent_name,  # a name it could not know: the worst case
                "ports": [port for _, port in ucx],  # and NIXL's default one
                "base_address": info.base_address,
                "num_bytes": info.block_bytes * 2,
            },
        )
        assert result == {"metadata": False, "read_error": result["read_error"], "bytes": 0}
        assert result["read_error"], "a READ without the peer's metadata must fail"
    finally:
        victim.close()


def test_a_worker_that_moves_kv_needs_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.transfer.kv_secret import resolve_kv_secret

    for name in ("KVRELAY_KV_SECRET", "KVRELAY_KV_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(KVSecretError, match="KVRELAY_KV_SECRET"):
        resolve_kv_secret()
    with pytest.raises(KVSecretError, match="at least 32 bytes"):
        KVSecret(b"short")
    assert "kvrelay" not in repr(SECRET) and SECRET.key.hex() not in repr(SECRET)
