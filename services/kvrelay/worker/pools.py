"""Pools: prefill and decode EngineWorker actors on Ray, and a request's way through them
(prefill -> KV pull by the decode worker -> decode -> release of the prefill lease)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.sampling import SamplingParams
from kvrelay.messages import EngineStats, KVHandle
from kvrelay.worker.actor import EngineWorker

logger = logging.getLogger(__name__)


def spawn_worker(
    engine_args: dict[str, Any],
    role: str,
    transfer_backend: str = "auto",
    num_threads: int = 1,
    *,
    num_cpus: float = 0,
    name: str | None = None,
    namespace: str | None = None,
    resources: dict[str, float] | None = None,
    node_id: str | None = None,
) -> Any:
    """Start one EngineWorker actor; a `name` makes it a detached, named actor that outlives
    its creator (found again by name), `node_id` pins it to a node."""
    import ray

    options: dict[str, Any] = {"num_cpus": num_cpus}
    if name is not None:
        options.update(name=name, namespace=namespace, lifetime="detached")
    if resources:
        options["resources"] = resources
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    actor = ray.remote(EngineWorker).options(**options)
    return actor.remote(engine_args, role, transfer_backend, num_threads)


class Pools:
    """Worker actors by role; build with `Pools.start`."""

    def __init__(
        self,
        prefill: list[Any],
        decode: list[Any],
        colocated: list[Any],
        owns_ray: bool,
        kv_transfer_failure: str = "recompute",
    ) -> None:
        self.prefill_workers = prefill
        self.decode_workers = decode
        self.colocated_workers = colocated
        self._owns_ray = owns_ray
        self.kv_transfer_failure = kv_transfer_failure
        # Requests decoded again from scratch because their prefill lease was gone when the
        # pull ended (the pulled blocks may have been reused by then).
        self.num_lease_recomputes = 0
        self._next_prefill = itertools.cycle(prefill) if prefill else None
        self._next_decode = itertools.cycle(decode) if decode else None
        self._next_colocated = itertools.cycle(colocated) if colocated else None

    @property
    def workers(self) -> list[Any]:
        return [*self.prefill_workers, *self.decode_workers, *self.colocated_workers]

    @classmethod
    def start(
        cls,
        model: str | None,
        num_prefill: int = 1,
        num_decode: int = 1,
        colocated: bool = False,
        transfer_backend: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        address: str | None = None,
        num_cpus_per_worker: float = 0,
        num_threads: int = 1,
    ) -> Pools:
        """Start Ray (unless it is up; `address` joins an existing cluster), the workers, and
        introduce every decode worker to every prefill worker. `colocated` starts
        `num_decode` "both" workers and no prefill pool."""
        import ray

        owns_ray = False
        if not ray.is_initialized():
            if address is None:
                ray.init(
                    num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING
                )
            else:
                ray.init(address=address)
            owns_ray = True
        engine_args = EngineArgs.from_kwargs(model, dict(engine_kwargs or {}))
        policy = engine_args.kv_transfer_failure
        args = dataclasses.asdict(engine_args)

        def spawn(role: str) -> Any:
            return spawn_worker(
                args, role, transfer_backend, num_threads, num_cpus=num_cpus_per_worker
            )

        if colocated:
            pools = cls([], [], [spawn("both") for _ in range(num_decode)], owns_ray, policy)
        else:
            prefill = [spawn("prefill") for _ in range(num_prefill)]
            decode = [spawn("decode") for _ in range(num_decode)]
            metas = ray.get([worker.kv_metadata.remote() for worker in prefill])
            ray.get([d.add_peer.remote(meta) for d in decode for meta in metas])
            pools = cls(prefill, decode, [], owns_ray, policy)
        ray.get([worker.health.remote() for worker in pools.workers])
        return pools

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> RequestOutput:
        """One request, whole; its finished output."""
        rid = request_id or uuid.uuid4().hex
        prompt = list(prompt_token_ids)
        if self._next_colocated is not None:
            worker = next(self._next_colocated)
            return await worker.generate_final.remote(rid, prompt, params)
        assert self._next_prefill is not None and self._next_decode is not None
        prefill, decode = next(self._next_prefill), next(self._next_decode)
        first: RequestOutput = await prefill.prefill.remote(rid, prompt, params)
        if first.kv_handle is None:
            return first  # finished at its first token
        handle = first.kv_handle
        last: RequestOutput | None = None
        lease_held: bool | None = None  # None: not asked yet, or the prefill worker is gone
        released = False
        try:
            stream = decode.generate.options(num_returns="streaming").remote(
                rid, prompt, params, handle
            )
            async for ref in stream:
                last = await ref
                if not released:
                    # The first output comes after the pull ended: a lease still held now was
                    # held through the whole pull, so the pulled blocks were the prompt's.
                    released = True
                    lease_held = await self._release(prefill, rid)
                    if lease_held is False:
                        break
        finally:
            if not released:
                await self._release(prefill, rid)
        if lease_held is False:
            return await self._lease_lost(decode, rid, prompt, params, handle, last)
        assert last is not None
        return last

    async def _release(self, prefill: Any, rid: str) -> bool | None:
        """Release `rid`'s prefill lease: whether it was still held; None when the prefill
        worker could not be reached (a dead one cannot reuse the blocks either)."""
        try:
            held: bool = await prefill.release_kv.remote(rid)
            return held
        except Exception:
            logger.warning("request %s: could not release its prefill KV lease", rid)
            return None

    async def _lease_lost(
        self,
        decode: Any,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        handle: KVHandle,
        last: RequestOutput | None,
    ) -> RequestOutput:
        """The prefill lease ended (expired) before the pull did: what was pulled may be
        another request's KV. Stop that decode, then recompute the prompt, or fail."""
        if last is None or not last.finished:
            await decode.abort.remote(rid)
        await decode.forget_kv.remote(handle)  # the pulled blocks may be cached: drop them
        reason = f"request {rid}: the prefill KV lease expired before the decode worker pulled it"
        if self.kv_transfer_failure == "fail":
            raise RuntimeError(
                f"KV transfer failed: {reason}; retry, raise kv_lease_seconds, "
                "or set kv_transfer_failure=recompute"
            )
        logger.warning("%s; recomputing its prompt on the decode worker", reason)
        self.num_lease_recomputes += 1
        output: RequestOutput = await decode.generate_final.remote(rid, prompt, params)
        return output

    def stats(self) -> list[EngineStats]:
        import ray

        return ray.get([worker.stats.remote() for worker in self.workers])

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            try:
                ray.get(worker.shutdown.remote(), timeout=30)
            except Exception:
                logger.warning("a worker did not shut down cleanly")
            ray.kill(worker)
        self.prefill_workers, self.decode_workers, self.colocated_workers = [], [], []
        if self._owns_ray:
            ray.shutdown()
