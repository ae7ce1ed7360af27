"""EngineWorker: one engine, its KV connector and its loop; a plain class that `pools.py`
turns into a Ray actor (so it is testable in-process too).

Every call that returns request output returns `OutputDelta`s (token ids and logprobs, no
text): the router detokenizes and orchestrates prefill -> pull -> decode (router/relay.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from kvrelay.common.messages import (
    GENERATION_ENV,
    NODE_NAME_ENV,
    POD_NAME_ENV,
    DrainState,
    EngineRequest,
    EngineStats,
    KVHandle,
    OutputDelta,
    PeerMetadata,
    Role,
    WorkerInfo,
    WorkerStatus,
)
from kvrelay.common.stream_wire import ChannelAddress
from kvrelay.engine.args import EngineArgs
from kvrelay.engine.engine import Engine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.transfer.base import KVConnector
from kvrelay.transfer.factory import create_connector
from kvrelay.transfer.kv_secret import KVSecret, resolve_kv_secret
from kvrelay.transfer.network import KVNetwork
from kvrelay.worker.core_share import step_threads_from_env
from kvrelay.worker.deltas import DeltaTracker, request_deltas
from kvrelay.worker.engine_builder import build_worker_engine, freeze_start_up_objects
from kvrelay.worker.engine_loop import EngineLoop
from kvrelay.worker.heap_trim import HeapTrimmer, interval_from_env
from kvrelay.worker.memory_probe import start_probe, structure_sizes
from kvrelay.worker.output_channels import OutputChannels
from kvrelay.worker.priority import raise_engine_priority

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which generation a worker belongs to and where it runs (WorkerInfo's fields)."""

    generation: str
    pod: str
    node: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Placement:
        """$KVRELAY_GENERATION, $KVRELAY_POD_NAME (default: the host name, which KubeRay sets
        to the pod's name) and $KVRELAY_NODE_NAME (default "")."""
        env = os.environ if environ is None else environ
        return cls(
            generation=env.get(GENERATION_ENV, "").strip(),
            pod=env.get(POD_NAME_ENV, "").strip() or socket.gethostname(),
            node=env.get(NODE_NAME_ENV, "").strip(),
        )


class EngineWorker:
    """A prefill, decode or colocated ("both") worker. The router streams its requests'
    outputs through `open_channel` + `start` (worker/output_channels.py: one stream per router,
    batched), the workers' one output path."""

    def __init__(
        self,
        engine_args: EngineArgs | dict[str, Any],
        role: Role | str = Role.BOTH,
        transfer_backend: str = "auto",
        num_threads: int = 1,
        connector_options: dict[str, Any] | None = None,
        kv_secret: KVSecret | None = None,
        *,
        own_process: bool = False,
    ) -> None:
        """`kv_secret`: the deployment's KV transfer secret (default: from the environment,
        $KVRELAY_KV_SECRET or $KVRELAY_KV_SECRET_FILE); a prefill or decode worker refuses to
        start without one. `own_process`: the worker has the process to itself (a Ray actor),
        so its start-up objects are frozen out of the garbage collector's walks once built
        (`freeze_start_up_objects`)."""
        raise_engine_priority()  # before the engine's threads start: they inherit it
        args = engine_args if isinstance(engine_args, EngineArgs) else EngineArgs(**engine_args)
        self.role = Role(role)
        args = dataclasses.replace(args, role=self.role.value, num_threads=num_threads)
        self.engine = build_worker_engine(args)
        self.connector: KVConnector | None = None
        if self.role.has_connector:
            self.connector = _connect(
                self.engine, self.role, transfer_backend, kv_secret, connector_options or {}
            )
        # Only a worker alone in its process trims its heap: elsewhere (tests, a caller's
        # process) the heap is not the worker's to manage.
        trimmer = HeapTrimmer(interval_from_env()) if own_process else None
        # On `kvrelay serve`'s core board (small machines): a prefill step may borrow idle cores.
        threads = step_threads_from_env(self.role.value, num_threads)
        self.loop = EngineLoop(
            self.engine, self.connector, heap_trimmer=trimmer, step_threads=threads
        )
        self.channels = OutputChannels(lambda request: request_deltas(self.loop, request))
        self.placement = Placement.from_env()
        # Set by a router's drain call; every router replica reads it when it polls status()
        # and sends no new request here (those in flight finish).
        self.state = DrainState.SERVING
        if own_process:
            freeze_start_up_objects()
        # Only with $KVRELAY_MEMORY_PROBE set; stopped by `shutdown`.
        self.memory_probe = start_probe(lambda: self._probe_sizes())

    def _probe_sizes(self) -> dict[str, int]:
        """The memory probe's view of this worker: its per-request structures' sizes and
        the heap trims so far."""
        sizes = structure_sizes(self)
        trimmer = self.loop.heap_trimmer
        if trimmer is not None:
            sizes["heap trims"] = trimmer.stats.trims
            sizes["heap trim released KiB"] = trimmer.stats.released_bytes >> 10
            sizes["heap trim ms"] = round(trimmer.stats.seconds * 1000)
        return sizes

    async def prefill(
        self, request: EngineRequest, decode_engine_id: str | None = None
    ) -> OutputDelta:
        """Prefill role: returns once the first token is out, as one delta whose `kv_handle`
        says where the prompt's KV waits for a decode worker (no handle when the request
        already finished at its first token). With `decode_engine_id` (the router's pick),
        only that engine may pull it; without, any one of the deployment's engines, once."""
        last: RequestOutput | int | None = None
        async for output in self.loop.outputs(request):
            last = output
        assert isinstance(last, RequestOutput)  # the last item is the finished output
        delta = DeltaTracker().delta(last)
        # Bound before anyone outside this worker learns the handle's id, so never unbound.
        if delta.kv_handle is not None and decode_engine_id is not None:
            self.engine.handoff.bind_handle(delta.kv_handle.handle_id, decode_engine_id)
        return delta

    async def open_channel(self, channel_id: str) -> ChannelAddress:
        """Where the router that named `channel_id` connects for its requests' deltas
        (worker/output_channels.py: `OutputChannels.open`)."""
        return await self.channels.open(channel_id)

    async def start(self, channel_id: str, tag: int, request: EngineRequest) -> None:
        """Start `request`, its deltas sent on the router's channel `channel_id` under `tag`;
        returns once it is queued. Its failure comes on the channel."""
        self.channels.start(channel_id, tag, request)

    def describe(self) -> WorkerInfo:
        engine = self.engine
        return WorkerInfo(
            role=self.role,
            engine_id=engine.engine_id,
            epoch=engine.epoch,
            block_size=engine.kv_cache.block_size,
            hash_extra_keys=engine.kv_cache.extra_keys,
            num_blocks=engine.num_blocks,
            max_model_len=engine.max_total_tokens,
            pid=os.getpid(),
            generation=self.placement.generation,
            pod=self.placement.pod,
            node=self.placement.node,
            name=_actor_name(),
        )

    def drain(self) -> WorkerInfo:
        """Take no new requests from now on (routers stop sending them once they poll
        `status`); those in flight finish. There is no way back: the pod is going away."""
        if self.state is not DrainState.DRAINING:
            logger.warning("worker %s is draining", self.engine.engine_id)
        self.state = DrainState.DRAINING
        return self.describe()

    def status(self) -> WorkerStatus:
        """Answers at once (it does not wait for the engine's step), like `health`."""
        return WorkerStatus(self.loop.is_alive(), self.state)

    async def release_kv(self, request_id: str) -> bool:
        """Prefill role: free a handed-off request's blocks; False if no lease was held."""
        return await self.loop.call(lambda engine: engine.release_kv(request_id))

    async def forget_kv(self, handle: KVHandle) -> int:
        """Decode role: drop `handle`'s prompt blocks from the prefix cache (a pull from a
        lease that ended early may have cached another prompt's KV under these hashes), so a
        recompute does not hit them. Returns how many were dropped."""

        hashes = handle.block_hashes
        return await self.loop.call(lambda engine: engine.forget_cached_blocks(hashes))

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def stats(self) -> EngineStats:
        return await self.loop.call(lambda engine: engine.stats())

    async def cached_block_hashes(self) -> list[bytes]:
        """The prefix-cache summary a router indexes: hashes of the full blocks cached here."""
        return await self.loop.call(lambda engine: engine.cached_block_hashes())

    def kv_metadata(self) -> PeerMetadata:
        """Prefill role: what decode workers need to pull from here (the router hands it to
        them over Ray; it is never served on a port)."""
        if self.connector is None or self.role is not Role.PREFILL:
            raise RuntimeError("only a prefill worker serves its KV blocks")
        return self.connector.metadata()

    def add_peer(self, meta: PeerMetadata) -> None:
        if self.connector is None:
            raise RuntimeError("a colocated worker has no KV connector")
        self.connector.add_peer(meta)

    def health(self) -> bool:
        return self.loop.is_alive()

    def shutdown(self) -> None:
        if self.memory_probe is not None:
            self.memory_probe.stop()
        self.channels.close()
        self.loop.shutdown()
        if self.connector is not None:
            self.connector.close()


def _actor_name() -> str:
    """This Ray actor's name ("" outside a named Ray actor: in-process tests, pools)."""
    try:
        import ray

        if not ray.is_initialized():
            return ""
        return ray.get_runtime_context().get_actor_name() or ""
    except Exception:  # not in an actor: a plain object in a test
        return ""


def _connect(
    engine: Engine,
    role: Role,
    backend: str,
    secret: KVSecret | None,
    options: dict[str, Any],
) -> KVConnector:
    """The worker's registered KV connector: a prefill worker serves the pulls its lease
    table allows, to holders of the secret; a decode worker serves nothing (no KV server)."""
    serves = role is Role.PREFILL
    connector = create_connector(
        backend,
        secret=resolve_kv_secret(secret),
        network=KVNetwork.from_env(),
        serve=serves,
        **options,
    )
    connector.register(engine.kv_tensor, engine.engine_id, engine.epoch)
    if serves:
        connector.authorize_pulls(engine.handoff.claim_pull)
    return connector
