"""The NIXL connector: a decode worker READs a prefill worker's KV blocks one-sidedly over UCX
(DRAM on CPU, VRAM on GPU). Peer info travels as protobuf, never pickle, and only over the
platform's control path (Ray): no NIXL listener serves it, and UCX listens on the configured
network devices only (loopback by default)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf.message import DecodeError

from kvrelay.common.messages import KVHandle, PeerMetadata, PullPlan
from kvrelay.transfer.base import KVConnector, TransferError, is_older_life, known_peer
from kvrelay.transfer.kv_regions import block_bytes, check_kv_tensor, check_plan
from kvrelay.transfer.network import UCX_NET_DEVICES_ENV
from kvrelay.transfer.nixl_api import create_agent, load_nixl_api
from kvrelay.transfer.runs import merge_runs
from kvrelay.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

BACKEND = "nixl"
_FIRST_POLL_S = 50e-6
_MAX_POLL_S = 1e-3  # sleeping between polls leaves the UCX progress thread a core


@dataclass(frozen=True)
class _Region:
    """A registered KV tensor, ours or a peer's: what a descriptor needs."""

    base_address: int
    num_blocks: int
    block_bytes: int
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"


def _text(name: str | bytes) -> str:
    # NIXL's binding returns agent names as bytes or str depending on the version.
    return name.decode() if isinstance(name, bytes) else name


@dataclass(frozen=True)
class _Peer:
    epoch: int
    agent_name: str
    region: _Region


class NixlConnector(KVConnector):
    """KV connector over NIXL. One agent per worker, created by `register`.

    Thread safety: the agent runs in NIXL's strict sync mode (every agent call locked), so
    `pull` may run on any thread, several at once; the prefill side needs no thread at all
    (reads are one-sided, served by UCX), so its engine may keep writing other blocks.
    """

    def __init__(
        self, *, timeout_s: float = 30.0, num_threads: int = 0, net_devices: str | None = "lo"
    ) -> None:
        """`timeout_s` bounds one pull; `num_threads` is UCX's worker count (0: its default);
        `net_devices`: the network devices UCX may listen on (UCX_NET_DEVICES syntax, e.g.
        "lo" or "eth0"; None leaves UCX's own setting, which is every interface)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._num_threads = num_threads
        self._net_devices = net_devices
        self._agent: Any = None
        self._agent_name = ""
        self._reg_descs: Any = None
        self._local: _Region | None = None
        self._engine_id = ""
        self._epoch = 0
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()  # guards _peers
        self._leaked: list[Any] = []  # transfers NIXL could not cancel: kept alive, see pull

    def register(self, kv_tensor: torch.Tensor, engine_id: str, epoch: int) -> None:
        if self._agent is not None:
            raise RuntimeError("register is called once per connector; make a new one")
        check_kv_tensor(kv_tensor)
        api = load_nixl_api()
        # The name is unique per life, so a restarted peer never collides with its old self.
        self._agent_name = f"kvrelay-{engine_id}-e{epoch}-{uuid.uuid4().hex[:8]}"
        if self._net_devices is not None:
            # UCX reads its settings from the environment when NIXL creates the backend; NIXL's
            # own "ucx_devices" parameter left UCX listening on the external address too
            # (measured with `ss -ltnp`), this does not.
            os.environ[UCX_NET_DEVICES_ENV] = self._net_devices
        config = api.nixl_agent_config(
            enable_prog_thread=True,
            # No metadata listener: peers get our metadata from the router, over Ray, only.
            enable_listen_thread=False,
            backends=["UCX"],
            num_threads=self._num_threads,
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = create_agent(api, self._agent_name, config)
        mem_type = "VRAM" if kv_tensor.is_cuda else "DRAM"
        device_id = (kv_tensor.device.index or 0) if kv_tensor.is_cuda else 0
        size = kv_tensor.numel() * kv_tensor.element_size()
        self._reg_descs = self._agent.register_memory(
            [(kv_tensor.data_ptr(), size, device_id, "")], mem_type
        )
        self._local = _Region(
            kv_tensor.data_ptr(), kv_tensor.shape[0], block_bytes(kv_tensor), device_id, mem_type
        )
        self._kv_tensor = kv_tensor  # keeps the registered memory alive
        self._engine_id, self._epoch = engine_id, epoch

    def metadata(self) -> PeerMetadata:
        local = self._registered()
        info = pb.NixlPeerInfo(
            agent_metadata=self._agent.get_agent_metadata(),
            agent_name=self._agent_name,
            base_address=local.base_address,
            num_blocks=local.num_blocks,
            block_bytes=local.block_bytes,
            device_id=local.device_id,
            mem_type=local.mem_type,
        )
        return PeerMetadata(self._engine_id, self._epoch, BACKEND, info.SerializeToString())

    def add_peer(self, peer: PeerMetadata) -> None:
        """Load the peer's agent; a newer epoch of a known engine replaces (and disconnects)
        the old one, an older epoch is ignored.

        Raises:
            ValueError: metadata of another backend, unreadable, or of another KV block layout.
        """
        local = self._registered()
        if peer.backend != BACKEND:
            raise ValueError(f"a {peer.backend!r} peer cannot be reached by the NIXL connector")
        if is_older_life(self._peers, self._lock, peer):
            return
        info = pb.NixlPeerInfo()
        try:
            info.ParseFromString(peer.payload)
        except DecodeError as exc:
            raise ValueError(f"peer {peer.engine_id}: unreadable NIXL metadata: {exc}") from exc
        if info.block_bytes != local.block_bytes:
            raise ValueError(
                f"peer {peer.engine_id} has {info.block_bytes}-byte KV blocks, this worker "
                f"{local.block_bytes}: both pools must serve the same model, dtype and "
                "block size"
            )
        if info.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"peer {peer.engine_id}: unknown memory type {info.mem_type!r}")
        with self._lock:
            old = self._peers.get(peer.engine_id)
            if old is not None and old.epoch >= peer.epoch:
                return  # one we already know, or older (raced with a newer add_peer)
            try:
                name = _text(self._agent.add_remote_agent(info.agent_metadata))
            except Exception as exc:  # NIXL's binding errors share no base class
                message = f"peer {peer.engine_id}: NIXL refused its metadata: {exc}"
                raise ValueError(message) from exc
            if old is not None and old.agent_name != name:
                self._forget(old)
            region = _Region(
                info.base_address, info.num_blocks, info.block_bytes, info.device_id, info.mem_type
            )
            self._peers[peer.engine_id] = _Peer(peer.epoch, name, region)
        logger.info("NIXL peer %s epoch %d added (agent %s)", peer.engine_id, peer.epoch, name)

    def pull(self, handle: KVHandle, plan: PullPlan) -> None:
        local = self._registered()
        peer = known_peer(self._peers, self._lock, handle)
        check_plan(plan, peer.region.num_blocks, local.num_blocks)
        runs = merge_runs(plan.remote_block_ids, plan.local_block_ids)
        if not runs:
            return
        size = local.block_bytes
        local_descs = [
            (local.base_address + r.local_start * size, r.length * size, local.device_id)
            for r in runs
        ]
        remote = peer.region
        remote_descs = [
            (remote.base_address + r.remote_start * size, r.length * size, remote.device_id)
            for r in runs
        ]
        what = f"pull of {plan.request_id!r} ({len(runs)} runs) from {handle.engine_id}"
        try:
            xfer = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local_descs, local.mem_type),
                self._agent.get_xfer_descs(remote_descs, remote.mem_type),
                peer.agent_name,
            )
        except Exception as exc:  # NIXL's binding errors share no base class
            raise TransferError(f"{what}: NIXL could not prepare it: {exc!r}") from exc
        deadline = time.monotonic() + self.timeout_s
        try:
            state = self._agent.transfer(xfer)
            state = self._wait(xfer, state, deadline)
        except Exception as exc:
            self._release(xfer)
            if isinstance(exc, TransferError):
                raise TransferError(f"{what}: {exc}") from None
            raise TransferError(f"{what}: NIXL failed: {exc!r}") from exc
        self._release(xfer)
        if state != "DONE":
            raise TransferError(f"{what}: NIXL reported {state} (the peer may be gone)")

    def close(self) -> None:
        if self._agent is None:
            return
        with self._lock:
            for peer in self._peers.values():
                self._forget(peer)
            self._peers.clear()
        try:
            self._agent.deregister_memory(self._reg_descs)
        except Exception as exc:  # closing anyway
            logger.warning("NIXL deregister_memory failed: %r", exc)
        self._agent = None

    def _wait(self, xfer: Any, state: str, deadline: float) -> str:
        pause = _FIRST_POLL_S
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferError(f"timed out after {self.timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_S)
            state = self._agent.check_xfer_state(xfer)
        return str(state)

    def _release(self, xfer: Any) -> None:
        """Release a transfer; NIXL cancels one still in flight, or refuses to."""
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:
            # A READ that cannot be cancelled may still land in our blocks later: keep its
            # handle alive and say so loudly; the caller must not reuse those blocks soon.
            logger.error("NIXL could not cancel a transfer (%r); it may still complete", exc)
            self._leaked.append(xfer)

    def _forget(self, peer: _Peer) -> None:
        try:
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:  # already gone is fine
            logger.warning("NIXL remove_remote_agent(%s) failed: %r", peer.agent_name, exc)

    def _registered(self) -> _Region:
        if self._local is None:
            raise RuntimeError("call register(kv_tensor, engine_id, epoch) first")
        return self._local
