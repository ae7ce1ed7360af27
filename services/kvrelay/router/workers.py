"""The router's view of the workers: who they are, how loaded, what they cache, who is alive.

Workers join through `add` (from `Pools`, or found by a discovery source); the registry
introduces every decode worker to every prefill worker (KV connector metadata) and polls
their status, stats and cached block hashes. A worker that stops answering is taken out of
routing; a draining one gets no new requests. Every call to a worker is bounded by a timeout:
a hung actor never stalls the refresh loop (stats, dead-worker removal, discovery).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.common.messages import (
    DrainState,
    EngineStats,
    PeerMetadata,
    Role,
    WorkerInfo,
    WorkerStatus,
)
from kvrelay.gateway_metrics import WorkerLoad
from kvrelay.router.kv_reach import warn_if_unreachable, warn_of_fallbacks
from kvrelay.router.prefix_index import PrefixIndex
from kvrelay.router.revisions import own_revision, pick_revision

logger = logging.getLogger(__name__)

Discover = Callable[[], Awaitable[Sequence[Any]]]  # -> the worker actors that exist now


@dataclass
class WorkerState:
    actor: Any  # the EngineWorker's Ray actor
    info: WorkerInfo
    stats: EngineStats | None = None
    in_flight: int = 0  # requests the router has at this worker now (fresher than stats)
    last_seen: float = 0.0
    # False while the worker says its engine loop is down (it gets no new requests then).
    healthy: bool = True
    # Set by a drain (here or at another router replica; polled): no new requests.
    draining: bool = False

    @property
    def worker_id(self) -> str:
        return self.info.engine_id

    @property
    def role(self) -> Role:
        return self.info.role

    @property
    def revision(self) -> str:
        """The deployment revision it runs (router/revisions.py; WorkerInfo's `generation`)."""
        return self.info.generation

    @property
    def serving(self) -> bool:
        """Whether it may take new requests: alive, engine loop running, not draining."""
        return self.healthy and not self.draining

    @property
    def requests_in_flight(self) -> int:
        """Requests at this worker, by its last stats (every router's) or by ours if more:
        running, waiting, pulling KV, or prefilled and waiting to be pulled (leases)."""
        stats = self.stats
        known = 0
        if stats is not None:
            known = stats.num_running + stats.num_waiting + stats.num_pulling + stats.num_leases
        return max(known, self.in_flight)

    @property
    def free_blocks(self) -> int:
        return self.stats.num_free_blocks if self.stats else self.info.num_blocks

    @property
    def kv_usage(self) -> float:
        return self.stats.kv_usage if self.stats else 0.0

    @property
    def queue_depth(self) -> int:
        waiting = self.stats.num_waiting if self.stats else 0
        return max(self.in_flight, waiting)


def actor_key(actor: Any) -> str:
    """A stable key of a Ray actor (its actor id)."""
    return str(actor._actor_id.hex())


class WorkerRegistry:
    def __init__(
        self,
        stats_timeout_s: float = 5.0,
        hashes_every: int = 4,
        discover: Discover | None = None,
        dead_after_s: float = 60.0,
        readopt_interval_s: float = 1.0,
        join_timeout_s: float = 600.0,
        revision: str | None = None,
    ) -> None:
        """`stats_timeout_s` bounds each call to a worker that is up; `join_timeout_s` how
        long `add` waits for a worker to come up (its engine loads its model first);
        `revision`: the one new requests prefer (default $KVRELAY_GENERATION; "" for any)."""
        self._dead_after_s = dead_after_s
        self._join_timeout_s = join_timeout_s
        self.revision = own_revision() if revision is None else revision
        self._readopt_interval_s = readopt_interval_s
        self.workers: dict[str, WorkerState] = {}
        self.index = PrefixIndex()
        self._stats_timeout_s = stats_timeout_s
        self._hashes_every = hashes_every
        self._discover = discover
        self._peer_metas: dict[str, PeerMetadata] = {}  # prefill worker id -> its metadata
        self._known_actors: set[str] = set()
        self._refreshes = 0
        self._lock = asyncio.Lock()
        # Removed workers' actors, watched until Ray has restarted them (they join again as
        # new engines) or they are gone for good: actor key -> its re-adoption task.
        self._readoptions: dict[str, asyncio.Task[None]] = {}
        # Discovered workers joining in the background (so a slow or hung one never holds up
        # a refresh): actor key -> its join task.
        self._joins: dict[str, asyncio.Task[None]] = {}
        # Pods being drained (told here, or seen on a polled worker): a worker that joins
        # from one (Ray restarted a drained actor in place) is drained at once, since its
        # new life does not have the flag.
        self.draining_pods: set[str] = set()

    def serving_revision(self) -> str | None:
        """The revision new requests go to (revisions.pick_revision); None: no worker can
        decode now."""
        serving = [(w.revision, w.role) for w in self.workers.values() if w.serving]
        return pick_revision(serving, self.revision)

    def healthy(self, role: Role, revision: str | None = None) -> list[WorkerState]:
        """The workers of `role` that may take new requests (alive, engine loop running, not
        draining), of `revision` (default: the serving revision), so that a prefill and a
        decode worker picked from these lists always pair within one revision."""
        if revision is None:
            revision = self.serving_revision()
        return [
            w
            for w in self.workers.values()
            if w.role == role and w.serving and (revision is None or w.revision == revision)
        ]

    def roles(self) -> set[Role]:
        """The roles of which at least one worker takes new requests (serving revision)."""
        return {role for role in Role if self.healthy(role)}

    def decode_token_capacity(self) -> int:
        """Tokens of KV the serving decode-capable workers hold together (0: none known)."""
        return sum(
            w.info.num_blocks * w.info.block_size
            for role in (Role.DECODE, Role.BOTH)
            for w in self.healthy(role)
        )

    def by_pool(self) -> dict[str, list[EngineStats]]:
        """Each pool's workers' latest stats (for the metrics)."""
        pools: dict[str, list[EngineStats]] = {}
        for worker in self.workers.values():
            if worker.stats is not None:
                pools.setdefault(worker.role.pool, []).append(worker.stats)
        return pools

    def loads(self) -> list[WorkerLoad]:
        """Every worker with stats: its id, pool, whether it serves, and its latest stats (for
        the per-worker and gateway metrics)."""
        return [
            WorkerLoad(w.worker_id, w.role.pool, w.serving, w.stats)
            for w in self.workers.values()
            if w.stats is not None
        ]

    async def add(self, actor: Any) -> WorkerState:
        """Register a worker: learn what it is and introduce it to its peers.

        Waits up to `join_timeout_s` for the worker to be up (a new one loads its model
        first), then bounds each call by `stats_timeout_s`; only those bounded calls run under
        the registry's lock, so one slow worker never holds up another's join.

        Raises:
            TimeoutError: the worker did not come up, or did not answer, in time.
            Exception: the worker's own error (RayActorError: it died).
        """
        key = actor_key(actor)
        self._known_actors.add(key)
        try:
            async with asyncio.timeout(self._join_timeout_s):
                await actor.health.remote()  # answers once its constructor has run
            async with self._lock:
                return await self._join(actor)
        except BaseException:
            self._known_actors.discard(key)  # found again (and retried) by discovery
            raise

    async def _join(self, actor: Any) -> WorkerState:
        info: WorkerInfo = await self._ask(actor.describe.remote())
        state = WorkerState(actor, info, last_seen=time.monotonic())
        status: WorkerStatus = await self._ask(actor.status.remote())
        state.healthy, state.draining = status.alive, status.state is DrainState.DRAINING
        if state.draining:
            self.draining_pods.add(info.pod)
        elif info.pod in self.draining_pods:
            await self._ask(actor.drain.remote())
            state.draining = True
            logger.warning("worker %s joined on draining pod %s: drained", info.engine_id, info.pod)
        if info.role is Role.PREFILL:
            meta: PeerMetadata = await self._ask(actor.kv_metadata.remote())
            await self._introduce(meta, info, self._decoders())
            self._peer_metas[info.engine_id] = meta
        elif info.role is Role.DECODE:
            for meta in self._peer_metas.values():
                prefill = self.workers.get(meta.engine_id)
                if prefill is not None:
                    warn_if_unreachable(meta, prefill.info, info)
            await self._ask(
                asyncio.gather(*(actor.add_peer.remote(m) for m in self._peer_metas.values()))
            )
        state.stats = await self._ask(actor.stats.remote())
        self.workers[info.engine_id] = state
        logger.warning(
            "worker %s (%s, pid %d, pod %s, revision %s) joined",
            info.engine_id,
            info.role,
            info.pid,
            info.pod or "-",
            info.generation or "-",
        )
        return state

    async def _ask(self, call: Awaitable[Any]) -> Any:
        """A call to a worker that is up, bounded by `stats_timeout_s` (TimeoutError)."""
        async with asyncio.timeout(self._stats_timeout_s):
            return await call

    async def _introduce(
        self, meta: PeerMetadata, prefill: WorkerInfo, decoders: Sequence[WorkerState]
    ) -> None:
        """Tell decode workers about a prefill worker, each within the stats timeout: a decode
        worker that is itself dead or restarting must not hold up the join (it is introduced
        to every prefill worker when it joins again)."""

        async def tell(decoder: WorkerState) -> None:
            warn_if_unreachable(meta, prefill, decoder.info)
            try:
                await self._ask(decoder.actor.add_peer.remote(meta))
            except Exception:
                logger.warning(
                    "decode worker %s did not take prefill worker %s's metadata",
                    decoder.worker_id,
                    meta.engine_id,
                    exc_info=True,
                )

        await asyncio.gather(*(tell(d) for d in decoders))

    def _decoders(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role is Role.DECODE]

    def remove(self, worker_id: str, reason: str) -> None:
        """Take a worker out of routing (it died or stopped answering)."""
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        self.index.remove(worker_id)
        self._peer_metas.pop(worker_id, None)
        logger.warning("worker %s (%s) removed from routing: %s", worker_id, state.role, reason)
        if state.actor is not None:
            self._watch_for_restart(state.actor)

    def _watch_for_restart(self, actor: Any) -> None:
        """Re-adopt the actor once Ray has restarted it (workers are started with
        max_restarts): it joins as a new engine, introduced to its peers like any other."""
        key = actor_key(actor)
        if key in self._readoptions:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): discovery finds it again, if any
        task = loop.create_task(self._readopt(actor))
        self._readoptions[key] = task
        task.add_done_callback(lambda _: self._readoptions.pop(key, None))

    async def _readopt(self, actor: Any) -> None:
        from ray.exceptions import ActorDiedError

        while True:
            try:
                async with asyncio.timeout(self._stats_timeout_s):
                    alive = await actor.health.remote()
                if alive:
                    await self.add(actor)
                    return
            except ActorDiedError:
                logger.info("a removed worker is gone for good (no restart)")
                return
            except Exception:  # restarting, or not answering yet
                logger.debug("a removed worker is not back yet", exc_info=True)
            await asyncio.sleep(self._readopt_interval_s)

    async def drain(self, pods: Collection[str]) -> list[WorkerState]:
        """Drain the workers on these pods: each one's own flag is set (so every router
        replica sees it when it polls), and this router stops sending them new requests at
        once. Returns those that took the drain (a worker that did not answer in time is
        left out, and logged)."""

        async def drain_one(worker: WorkerState) -> WorkerState | None:
            try:
                await self._ask(worker.actor.drain.remote())
            except Exception:
                logger.warning("worker %s did not take the drain", worker.worker_id, exc_info=True)
                return None
            worker.draining = True
            return worker

        self.draining_pods.update(pods)
        targets = [w for w in self.workers.values() if w.info.pod in pods]
        drained = await asyncio.gather(*(drain_one(w) for w in targets))
        return [w for w in drained if w is not None]

    async def close(self) -> None:
        """Stop watching removed workers and joining found ones (at shutdown)."""
        tasks = list(self._readoptions.values()) + list(self._joins.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def refresh(self) -> None:
        """Poll every worker's stats (and every few rounds its cached block hashes)."""
        self._refreshes += 1
        with_hashes = self._refreshes % self._hashes_every == 1
        await asyncio.gather(*(self._poll(w, with_hashes) for w in list(self.workers.values())))
        if self._discover is not None:
            await self._add_discovered()

    async def _poll(self, worker: WorkerState, with_hashes: bool) -> None:
        try:
            async with asyncio.timeout(self._stats_timeout_s):
                # status() answers at once (it does not wait for the engine's step).
                status: WorkerStatus = await worker.actor.status.remote()
                worker.healthy = status.alive
                worker.draining = status.state is DrainState.DRAINING
                if worker.draining:
                    self.draining_pods.add(worker.info.pod)
                stats: EngineStats = await worker.actor.stats.remote()
                warn_of_fallbacks(worker.info, worker.stats, stats)
                worker.stats = stats
                if with_hashes:
                    hashes = await worker.actor.cached_block_hashes.remote()
                    self.index.replace(worker.worker_id, hashes)
            worker.last_seen = time.monotonic()
        except TimeoutError:
            # Stats wait for the engine's current step: a long prefill step is slow, not dead.
            silent = time.monotonic() - worker.last_seen
            if silent > self._dead_after_s:
                self.remove(worker.worker_id, f"no answer for {silent:.0f} s")
        except Exception as exc:  # RayActorError: the actor (or its node) is gone
            logger.debug("worker %s: poll failed", worker.worker_id, exc_info=True)
            self.remove(worker.worker_id, f"{type(exc).__name__}: {exc}")

    async def _add_discovered(self) -> None:
        """Start a background join for each new worker discovery finds (bounded: `add`)."""
        assert self._discover is not None
        try:
            async with asyncio.timeout(self._stats_timeout_s):
                actors = await self._discover()
        except Exception:
            logger.exception("worker discovery failed")
            return
        for actor in actors:
            key = actor_key(actor)
            if key in self._known_actors or key in self._joins or key in self._readoptions:
                continue
            task = asyncio.get_running_loop().create_task(self._join_found(actor))
            self._joins[key] = task
            task.add_done_callback(self._forget_join(key))

    def _forget_join(self, key: str) -> Callable[[asyncio.Task[None]], None]:
        def forget(_: asyncio.Task[None]) -> None:
            self._joins.pop(key, None)

        return forget

    async def _join_found(self, actor: Any) -> None:
        try:
            await self.add(actor)
        except Exception:
            logger.warning("a discovered worker could not join; retrying", exc_info=True)

    async def run(self, interval_s: float = 0.5) -> None:
        """Poll forever (a background task; cancel it to stop)."""
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.exception("refreshing the workers' stats failed; retrying")
            await asyncio.sleep(interval_s)
