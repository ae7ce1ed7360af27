"""The gRPC fallback's serving side: streams raw bytes of a worker's KV blocks to pullers.
Reads only; never writes the KV tensor, never unpickles anything."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch

from kvrelay.transfer.kv_regions import block_byte_rows, block_bytes
from kvrelay.transfer.runs import merge_runs
from kvrelay.v1 import kv_transfer_pb2 as pb
from kvrelay.v1 import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 2 << 20  # below gRPC's 4 MiB default message limit
MAX_MESSAGE_BYTES = 16 << 20  # both sides allow more, so a larger chunk_bytes still works


class KVTransferServicer(pb_grpc.KVTransferServicer):
    """Serves `PullBlocks` from one registered KV tensor of one engine life."""

    def __init__(
        self, kv_tensor: torch.Tensor, engine_id: str, epoch: int, chunk_bytes: int
    ) -> None:
        self._rows = block_byte_rows(kv_tensor)  # [num_blocks, block_bytes] uint8
        self._block_bytes = block_bytes(kv_tensor)
        self._engine_id = engine_id
        self._epoch = epoch
        self._chunk_bytes = chunk_bytes

    def PullBlocks(  # the generated servicer names it so
        self, request: pb.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.BlockChunk]:
        if request.engine_id != self._engine_id or request.epoch != self._epoch:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server is {self._engine_id} epoch {self._epoch}, not "
                f"{request.engine_id} epoch {request.epoch}: the handle is stale",
            )
        if request.block_bytes != self._block_bytes:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks here are {self._block_bytes} bytes, the puller expects "
                f"{request.block_bytes}: both pools must serve the same model and block size",
            )
        num_blocks = self._rows.shape[0]
        bad = [b for b in request.block_ids if b >= num_blocks]
        if bad:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"block ids {bad[:8]} are outside [0, {num_blocks})",
            )
        ids = list(request.block_ids)
        offset = 0
        # Runs of consecutive ids are contiguous bytes: chunk them without gathering blocks.
        for run in merge_runs(ids, range(len(ids))):
            region = self._rows[run.remote_start : run.remote_start + run.length].view(-1)
            if region.is_cuda:
                region = region.cpu()
            view = region.numpy().data  # a memoryview: slicing it copies nothing
            for start in range(0, len(view), self._chunk_bytes):
                data = view[start : start + self._chunk_bytes].tobytes()
                yield pb.BlockChunk(offset=offset, data=data)
                offset += len(data)


def start_server(
    servicer: KVTransferServicer, host: str, port: int, max_workers: int
) -> tuple[grpc.Server, int]:
    """Start a KVTransfer server on `host:port` (port 0: an ephemeral one); returns it and
    the bound port.

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-transfer"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_KVTransferServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind the KV transfer server to {host}:{port}: {exc}") from exc
    if bound == 0:
        raise RuntimeError(f"cannot bind the KV transfer server to {host}:{port}; pick a free port")
    server.start()
    logger.info("KV transfer (gRPC) serving on %s:%d", host, bound)
    return server, bound
