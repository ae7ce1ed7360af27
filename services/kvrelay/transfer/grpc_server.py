"""The gRPC fallback's serving side: streams raw bytes of a worker's leased KV blocks to
authenticated pullers. Reads only; never writes the KV tensor, never unpickles anything."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch

from kvrelay.transfer.kv_regions import StagingPool, block_byte_rows, block_bytes
from kvrelay.transfer.kv_secret import NOT_AUTHORIZED, ClaimPull, KVSecret
from kvrelay.transfer.runs import merge_runs
from kvrelay.v1 import kv_transfer_pb2 as pb
from kvrelay.v1 import kv_transfer_pb2_grpc as pb_grpc
from kvrelay_kernels.cpu_threads import use_one_cpu_thread

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 2 << 20  # below gRPC's 4 MiB default message limit
MAX_MESSAGE_BYTES = 16 << 20  # both sides allow more, so a larger chunk_bytes still works


class KVTransferServicer(pb_grpc.KVTransferServicer):
    """Serves `PullBlocks` from one registered KV tensor of one engine life, to pullers that
    prove they hold the deployment's secret and name a lease `claim` grants.

    Until `claim` is set (the worker attaches its engine's lease table) every pull is refused.
    """

    def __init__(
        self,
        kv_tensor: torch.Tensor,
        engine_id: str,
        epoch: int,
        chunk_bytes: int,
        secret: KVSecret | None,
    ) -> None:
        self._rows = block_byte_rows(kv_tensor)  # [num_blocks, block_bytes] uint8
        self._block_bytes = block_bytes(kv_tensor)
        self._engine_id = engine_id
        self._epoch = epoch
        self._chunk_bytes = chunk_bytes
        self._secret = secret
        # A device cache is read through reusable pinned buffers, one device -> host copy per
        # chunk, the next chunk's copy overlapping this one's send (kv_regions.PinnedStaging).
        self._staging = StagingPool(kv_tensor.device, chunk_bytes) if kv_tensor.is_cuda else None
        self.claim: ClaimPull | None = None

    def PullBlocks(  # the generated servicer names it so
        self, request: pb.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.BlockChunk]:
        ids = list(request.block_ids)
        refusal = self._refusal(request, ids)
        if refusal is not None:
            code, reason, answer = refusal
            logger.warning(
                "KV pull refused (%s) from %s: engine %r asked %s epoch %d for %d blocks of "
                "request %r under handle %s...",
                reason,
                context.peer(),
                request.requester_engine_id,
                request.engine_id,
                request.epoch,
                len(ids),
                request.request_id,
                request.handle_id[:6],  # enough to find it in the logs, too little to use
            )
            context.abort(code, answer)
        offset = 0
        # Runs of consecutive ids are contiguous bytes: chunk them without gathering blocks.
        for run in merge_runs(ids, range(len(ids))):
            region = self._rows[run.remote_start : run.remote_start + run.length].view(-1)
            for data in self._chunks(region):
                yield pb.BlockChunk(offset=offset, data=data)
                offset += len(data)

    def _chunks(self, region: torch.Tensor) -> Iterator[bytes]:
        """`region`'s bytes in pieces of at most chunk_bytes: host memory sliced in place, a
        device cache staged through pinned buffers."""
        if self._staging is not None:
            with self._staging.lease() as staging:
                yield from staging.read(region)
            return
        view = region.numpy().data  # a memoryview: slicing it copies nothing
        for start in range(0, len(view), self._chunk_bytes):
            yield view[start : start + self._chunk_bytes].tobytes()

    def _refusal(
        self, request: pb.PullBlocksRequest, ids: list[int]
    ) -> tuple[grpc.StatusCode, str, str] | None:
        """None when the pull may go ahead (its handle is then spent); else the status code,
        the reason for the log, and the answer for the caller.

        The credential is checked first and alone decides what an outsider hears: one text,
        whatever else is wrong, so no answer tells engine ids, epochs, block sizes or counts,
        or whether a handle exists, to anyone without the secret.
        """
        denied = grpc.StatusCode.PERMISSION_DENIED
        if self._secret is None:
            return denied, "this server has no KV secret", NOT_AUTHORIZED
        expected = self._secret.pull_proof(
            request.engine_id,
            request.epoch,
            request.handle_id,
            request.requester_engine_id,
            ids,
            request.block_bytes,
        )
        if not self._secret.verify(request.proof, expected):
            return denied, "no valid credential", NOT_AUTHORIZED
        if request.engine_id != self._engine_id or request.epoch != self._epoch:
            stale = "the KV handle is from another life of this worker: recompute the prompt"
            return grpc.StatusCode.FAILED_PRECONDITION, "a stale handle", stale
        if request.block_bytes != self._block_bytes:
            layout = (
                "the KV block layouts differ: both pools must serve one model, dtype and block size"
            )
            return grpc.StatusCode.INVALID_ARGUMENT, "another block size", layout
        if any(b >= self._rows.shape[0] for b in ids):
            return denied, "block ids out of range", NOT_AUTHORIZED
        claim = self.claim
        if claim is None:
            return denied, "no lease table attached yet", NOT_AUTHORIZED
        if not claim(request.handle_id, request.requester_engine_id, ids):
            return denied, "the lease table refused the handle", NOT_AUTHORIZED
        return None


def start_server(
    servicer: KVTransferServicer,
    host: str,
    port: int,
    max_workers: int,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """Start a KVTransfer server on `host:port` (port 0: an ephemeral one); returns it and
    the bound port. `credentials`: TLS (transfer/tls.py), None for plaintext.

    Raises:
        RuntimeError: the address could not be bound.
    """
    # Reads run beside the engine's steps: one CPU thread each (kvrelay_kernels/cpu_threads.py).
    threads = futures.ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix="kv-transfer", initializer=use_one_cpu_thread
    )
    server = grpc.server(
        threads,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_KVTransferServicer_to_server(servicer, server)
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind the KV transfer server to {host}:{port}: {exc}") from exc
    if bound == 0:
        raise RuntimeError(f"cannot bind the KV transfer server to {host}:{port}; pick a free port")
    server.start()
    mode = "plaintext" if credentials is None else "mTLS"
    logger.info("KV transfer (gRPC, %s) serving on %s:%d", mode, host, bound)
    return server, bound
