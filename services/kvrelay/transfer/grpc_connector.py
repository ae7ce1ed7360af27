"""The gRPC fallback connector: a decode worker streams a prefill worker's KV block bytes over
`kvrelay.v1.KVTransfer/PullBlocks` and writes them straight into its own blocks (no pickle).
Every pull carries a proof made with the deployment's KV secret (transfer/kv_secret.py); the channel
runs mTLS when the worker has a certificate (transfer/tls.py), plaintext otherwise. A GPU KV
tensor is written through reusable pinned host buffers, one host -> device copy per chunk
(kv_regions.PinnedStaging); a CPU one straight from the received bytes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kvrelay.common.messages import KVHandle, PeerMetadata, PullPlan
from kvrelay.transfer.base import (
    KVConnector,
    StalePeerError,
    TransferError,
    is_older_life,
    known_peer,
)
from kvrelay.transfer.grpc_server import (
    DEFAULT_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    KVTransferServicer,
    start_server,
)
from kvrelay.transfer.kv_regions import (
    PinnedStaging,
    StagingPool,
    block_byte_rows,
    check_block_ids,
    check_kv_tensor,
    chunk_segments,
    flat_bytes,
)
from kvrelay.transfer.kv_secret import ClaimPull, KVSecret
from kvrelay.transfer.network import is_wildcard
from kvrelay.transfer.tls import KVTLS
from kvrelay.v1 import kv_transfer_pb2 as pb
from kvrelay.v1 import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

BACKEND = "grpc"
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_TLS_HINT = (
    "with KV TLS on, every worker needs a certificate signed by $KVRELAY_KV_TLS_CA, issued "
    "for the address peers dial or for $KVRELAY_KV_TLS_SERVER_NAME"
)


@dataclass(frozen=True)
class _Peer:
    epoch: int
    address: str
    channel: grpc.Channel
    stub: pb_grpc.KVTransferStub


class GrpcConnector(KVConnector):
    """KV connector over gRPC. `register` starts this worker's KVTransfer server (unless
    `serve=False`, for a worker nobody pulls from); it serves only pulls that `authorize_pulls`
    allows, from pullers holding `secret`. Without a secret nothing is served or pulled. With
    `tls`, both its server and its channels to peers are mutually authenticated TLS.

    Thread safety: `pull` may run on any thread, several at once (one channel per peer, which
    gRPC shares safely); the server reads blocks on its own thread pool while the engine keeps
    writing other blocks (leased blocks are not written until released).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        serve: bool = True,
        max_workers: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 30.0,
        secret: KVSecret | None = None,
        tls: KVTLS | None = None,
    ) -> None:
        """`host`/`port`: where the server binds (port 0: ephemeral); `advertise_host`: what
        peers dial, when it differs from `host` (e.g. the pod IP for a 0.0.0.0 bind);
        `timeout_s` bounds a pull; `secret`: the deployment's KV secret; `tls`: this worker's
        mTLS material (None: plaintext; every worker of a deployment must agree)."""
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 1024:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - 1024}]")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.host, self.port, self.serve = host, port, serve
        self.advertise_host = advertise_host or host
        if serve and is_wildcard(self.advertise_host):
            raise ValueError(
                f"a KV server bound to {host} needs advertise_host: the address peers dial "
                f"({self.advertise_host} reaches every peer's own host, not this one)"
            )
        self.timeout_s = timeout_s
        self._max_workers = max_workers
        self._chunk_bytes = chunk_bytes
        self._secret = secret
        self._tls = tls
        self._server: grpc.Server | None = None
        self._servicer: KVTransferServicer | None = None
        self._rows: torch.Tensor | None = None  # our KV tensor as [num_blocks, block_bytes]
        self._flat: torch.Tensor | None = None  # the same memory as flat bytes
        self._flat_np: np.ndarray | None = None  # the same again, on CPU only
        self._staging: StagingPool | None = None  # pinned buffers for GPU pulls
        self._engine_id = ""
        self._epoch = 0
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()  # guards _peers

    def register(self, kv_tensor: torch.Tensor, engine_id: str, epoch: int) -> None:
        if self._rows is not None:
            raise RuntimeError("register is called once per connector; make a new one")
        check_kv_tensor(kv_tensor)
        self._rows = block_byte_rows(kv_tensor)
        self._flat = flat_bytes(kv_tensor)
        if kv_tensor.is_cuda:
            # Sized for our own chunk size; a peer sending larger chunks grows a buffer once.
            self._staging = StagingPool(kv_tensor.device, self._chunk_bytes)
        else:
            self._flat_np = self._flat.numpy()
        self._engine_id, self._epoch = engine_id, epoch
        if self.serve:
            self._servicer = KVTransferServicer(
                kv_tensor, engine_id, epoch, self._chunk_bytes, self._secret
            )
            credentials = None if self._tls is None else self._tls.server_credentials()
            self._server, self.port = start_server(
                self._servicer, self.host, self.port, self._max_workers, credentials
            )

    def authorize_pulls(self, claim: ClaimPull) -> None:
        """Serve only the pulls `claim` allows (the engine's lease table decides)."""
        if self._servicer is None:
            raise RuntimeError("authorize_pulls needs register() on a serving connector")
        self._servicer.claim = claim

    def metadata(self) -> PeerMetadata:
        if self._rows is None or self._server is None:
            raise RuntimeError("metadata needs register() on a serving connector (serve=True)")
        address = f"{self.advertise_host}:{self.port}"
        return PeerMetadata(self._engine_id, self._epoch, BACKEND, address.encode())

    def add_peer(self, peer: PeerMetadata) -> None:
        """Open a channel to the peer's server; a newer epoch replaces the old channel, an older
        epoch is ignored.

        Raises:
            ValueError: metadata of another backend, or not a `host:port` address.
        """
        if peer.backend != BACKEND:
            raise ValueError(f"a {peer.backend!r} peer cannot be reached by the gRPC connector")
        if is_older_life(self._peers, self._lock, peer):
            return
        try:
            address = peer.payload.decode()
        except UnicodeDecodeError as exc:
            raise ValueError(f"peer {peer.engine_id}: payload is not an address") from exc
        if ":" not in address:
            raise ValueError(f"peer {peer.engine_id}: {address!r} is not host:port")
        with self._lock:
            old = self._peers.get(peer.engine_id)
            if old is not None and (
                old.epoch > peer.epoch or (old.epoch == peer.epoch and old.address == address)
            ):
                return  # a late message about an older life, or one we already know
            channel = self._channel(address)
            stub = pb_grpc.KVTransferStub(channel)
            self._peers[peer.engine_id] = _Peer(peer.epoch, address, channel, stub)
        if old is not None:
            old.channel.close()
        logger.info("gRPC peer %s epoch %d at %s", peer.engine_id, peer.epoch, address)

    def pull(self, handle: KVHandle, plan: PullPlan) -> None:
        rows = self._rows
        if rows is None:
            raise RuntimeError("call register(kv_tensor, engine_id, epoch) first")
        peer = known_peer(self._peers, self._lock, handle)
        if len(plan.remote_block_ids) != len(plan.local_block_ids):
            raise TransferError(f"pull plan {plan.request_id!r} does not pair its blocks 1:1")
        check_block_ids(plan.local_block_ids, rows.shape[0], "local")
        if not plan.local_block_ids:
            return
        request = self._request(handle, plan, rows.shape[1])
        what = f"pull of {plan.request_id!r} from {handle.engine_id} at {peer.address}"
        expected = len(plan.local_block_ids) * rows.shape[1]
        received = 0
        try:
            with self._staged() as staging:
                for chunk in peer.stub.PullBlocks(request, timeout=self.timeout_s):
                    if chunk.offset != received or received + len(chunk.data) > expected:
                        raise TransferError(f"{what}: bytes out of order at offset {chunk.offset}")
                    self._write(plan.local_block_ids, chunk.offset, chunk.data, staging)
                    received += len(chunk.data)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise StalePeerError(f"{what}: {details}; recompute the prompt") from None
            if code == grpc.StatusCode.PERMISSION_DENIED:
                raise TransferError(
                    f"{what}: {details} (the prefill worker's log says why: a missing or wrong "
                    "KV secret, or a spent, expired or someone else's handle)"
                ) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TransferError(f"{what}: timed out after {self.timeout_s} s") from None
            if code == grpc.StatusCode.UNAVAILABLE and self._tls is not None:
                details = f"{details} ({_TLS_HINT})"
            raise TransferError(f"{what}: {code.name}: {details}") from None
        if received != expected:
            raise TransferError(f"{what}: got {received} of {expected} bytes")

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            peer.channel.close()
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def _channel(self, address: str) -> grpc.Channel:
        if self._tls is None:
            return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        options = _CHANNEL_OPTIONS + self._tls.channel_options()
        return grpc.secure_channel(address, self._tls.channel_credentials(), options=options)

    def _request(self, handle: KVHandle, plan: PullPlan, block_bytes: int) -> pb.PullBlocksRequest:
        """The request for `plan`, with its proof (TransferError when no secret is set)."""
        if self._secret is None:
            raise TransferError("this worker has no KV secret: it cannot pull KV blocks")
        proof = self._secret.pull_proof(
            handle.engine_id,
            handle.epoch,
            handle.handle_id,
            self._engine_id,
            plan.remote_block_ids,
            block_bytes,
        )
        return pb.PullBlocksRequest(
            engine_id=handle.engine_id,
            epoch=handle.epoch,
            request_id=plan.request_id,
            block_ids=plan.remote_block_ids,
            block_bytes=block_bytes,
            handle_id=handle.handle_id,
            requester_engine_id=self._engine_id,
            proof=proof,
        )

    @contextmanager
    def _staged(self) -> Iterator[PinnedStaging | None]:
        """A pinned staging for one pull into a GPU tensor (every copy landed on exit, so a
        finished pull's blocks are readable by the engine's stream); None for a CPU tensor."""
        if self._staging is None:
            yield None
            return
        with self._staging.lease() as staging:
            yield staging

    def _write(
        self,
        local_block_ids: tuple[int, ...],
        offset: int,
        data: bytes,
        staging: PinnedStaging | None,
    ) -> None:
        """Copy `data`, at `offset` of the concatenated pulled blocks, into our blocks."""
        assert self._rows is not None
        segments = chunk_segments(local_block_ids, self._rows.shape[1], offset, len(data))
        if staging is not None:
            assert self._flat is not None
            staging.write(self._flat, segments, data)
            return
        assert self._flat_np is not None
        for seg in segments:
            src = np.frombuffer(data, dtype=np.uint8, count=seg.nbytes, offset=seg.src)
            self._flat_np[seg.dst : seg.dst + seg.nbytes] = src
