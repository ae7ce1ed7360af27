"""Checks and byte views of a block-major KV tensor, and the pinned host staging that moves
its bytes between a GPU and byte strings; shared by the connectors (no transport here)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

from kvrelay.common.messages import PullPlan
from kvrelay.transfer.base import TransferError

KV_TENSOR_DIMS = 6  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]


def check_kv_tensor(kv_tensor: torch.Tensor) -> None:
    """Raise ValueError unless `kv_tensor` is a contiguous block-major KV tensor."""
    if kv_tensor.dim() != KV_TENSOR_DIMS:
        raise ValueError(
            f"expected a block-major KV tensor [num_blocks, num_layers, 2, block_size, "
            f"num_kv_heads, head_dim], got shape {tuple(kv_tensor.shape)}"
        )
    if not kv_tensor.is_contiguous():
        raise ValueError("the KV tensor must be contiguous: register the engine's own tensor")
    if kv_tensor.shape[0] == 0:
        raise ValueError("the KV tensor has no blocks")


def block_bytes(kv_tensor: torch.Tensor) -> int:
    """Bytes of one block (all layers, K and V)."""
    return kv_tensor[0].numel() * kv_tensor.element_size()


def block_byte_rows(kv_tensor: torch.Tensor) -> torch.Tensor:
    """`kv_tensor` as `[num_blocks, block_bytes]` uint8, sharing its memory."""
    return kv_tensor.view(-1).view(torch.uint8).view(kv_tensor.shape[0], -1)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> None:
    """Raise TransferError when an id is outside `[0, num_blocks)` (`side`: for the message)."""
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise TransferError(
            f"{side} block ids {bad[:8]} are outside [0, {num_blocks}): the plan does not "
            "match that KV tensor; recompute the prompt instead"
        )


def check_plan(plan: PullPlan, remote_blocks: int, local_blocks: int) -> None:
    """Both sides' ids in range and paired one to one, or TransferError."""
    if len(plan.remote_block_ids) != len(plan.local_block_ids):
        raise TransferError(
            f"pull plan {plan.request_id!r} pairs {len(plan.remote_block_ids)} remote blocks "
            f"with {len(plan.local_block_ids)} local ones; build it with add_prefilled_request"
        )
    check_block_ids(plan.remote_block_ids, remote_blocks, "remote")
    check_block_ids(plan.local_block_ids, local_blocks, "local")


class Segment(NamedTuple):
    """`nbytes` bytes at `src` of a received chunk belong at byte `dst` of the flat KV tensor."""

    dst: int
    src: int
    nbytes: int


def chunk_segments(
    block_ids: Sequence[int], block_bytes: int, offset: int, length: int
) -> list[Segment]:
    """Where the bytes `[offset, offset + length)` of the blocks `block_ids`, concatenated in
    that order (how a pull streams them), lie in the flat KV tensor. Consecutive block ids are
    consecutive bytes there, so they merge: one segment (one copy) per run of ids."""
    segments: list[Segment] = []
    done = 0
    while done < length:
        index, within = divmod(offset + done, block_bytes)
        count = min(block_bytes - within, length - done)
        dst = block_ids[index] * block_bytes + within
        if segments and segments[-1].dst + segments[-1].nbytes == dst:
            last = segments[-1]
            segments[-1] = Segment(last.dst, last.src, last.nbytes + count)
        else:
            segments.append(Segment(dst, done, count))
        done += count
    return segments


def flat_bytes(kv_tensor: torch.Tensor) -> torch.Tensor:
    """`kv_tensor` as one flat uint8 tensor, sharing its memory."""
    return kv_tensor.view(-1).view(torch.uint8)


class PinnedStaging:
    """Reusable host buffers for a GPU KV tensor's bytes: each chunk of a pull goes host ->
    device in one asynchronous copy per segment (one per chunk when the local blocks are
    consecutive) from page-locked memory, on a side stream, while the next chunk is received;
    each chunk served is read device -> host in one copy while the previous one is sent.

    `depth` buffers rotate; a buffer is refilled only after its last copy completed (its
    event). Not thread-safe: one pull or one served stream at a time (see StagingPool). On a
    CPU device the same logic runs with plain buffers and synchronous copies (for tests; the
    connectors copy host tensors directly).
    """

    def __init__(self, device: torch.device, chunk_bytes: int, depth: int = 2) -> None:
        if chunk_bytes <= 0 or depth < 1:
            raise ValueError(f"chunk_bytes must be > 0 and depth >= 1, got {chunk_bytes}, {depth}")
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self.num_allocations = 0  # host buffers allocated so far (reuse keeps it at `depth`)

    def _take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next buffer, at least `nbytes` long, once its previous copy has completed."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, self.chunk_bytes)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
            self._buffers[slot] = buffer
            self.num_allocations += 1
        return slot, buffer

    def _record(self, slot: int) -> None:
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._events[slot] = event

    def begin(self) -> None:
        """Order this staging's copies after the work already queued on the device's current
        stream (e.g. the engine's last writes into blocks a pull now reuses)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def write(self, flat: torch.Tensor, segments: Sequence[Segment], data: bytes) -> None:
        """Copy `data` into `flat` (the KV tensor's bytes) at `segments`: one host memcpy into
        a pinned buffer, then one asynchronous host -> device copy per segment."""
        slot, buffer = self._take(len(data))
        host = buffer[: len(data)]
        host.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        with self._on_stream():
            for seg in segments:
                dst = flat[seg.dst : seg.dst + seg.nbytes]
                dst.copy_(host[seg.src : seg.src + seg.nbytes], non_blocking=self._cuda)
        self._record(slot)

    def read(self, region: torch.Tensor) -> Iterator[bytes]:
        """`region` (flat uint8 on the device) as byte strings of at most `chunk_bytes`, each
        one device -> host copy; the next chunk's copy runs while the caller sends this one."""
        pending: list[tuple[int, torch.Tensor]] = []
        for start in range(0, region.numel(), self.chunk_bytes):
            part = region[start : start + self.chunk_bytes]
            slot, buffer = self._take(part.numel())
            host = buffer[: part.numel()]
            with self._on_stream():
                host.copy_(part, non_blocking=self._cuda)
            self._record(slot)
            pending.append((slot, host))
            if len(pending) == len(self._buffers):
                yield self._ready(*pending.pop(0))
        for slot, host in pending:
            yield self._ready(slot, host)

    def _ready(self, slot: int, host: torch.Tensor) -> bytes:
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return host.numpy().tobytes()

    def finish(self) -> None:
        """Block until every copy issued so far has landed."""
        if self._stream is not None:
            self._stream.synchronize()

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield


class StagingPool:
    """PinnedStaging objects for concurrent pulls: each pull leases one and gives it back
    (page-locked allocations are slow, so they are reused, never made per pull)."""

    def __init__(self, device: torch.device, chunk_bytes: int, depth: int = 2) -> None:
        self.device, self.chunk_bytes, self.depth = device, chunk_bytes, depth
        self._free: list[PinnedStaging] = []
        self._lock = threading.Lock()
        self.num_created = 0

    @contextmanager
    def lease(self) -> Iterator[PinnedStaging]:
        """A staging for one pull: `begin()` done on entry, `finish()` on exit (every byte
        has landed when the block ends, errors included, before the staging is reused)."""
        with self._lock:
            staging = self._free.pop() if self._free else None
            if staging is None:
                self.num_created += 1
        if staging is None:
            staging = PinnedStaging(self.device, self.chunk_bytes, self.depth)
        staging.begin()
        try:
            yield staging
        finally:
            staging.finish()
            with self._lock:
                self._free.append(staging)
