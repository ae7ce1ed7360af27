"""Pools: start and stop prefill, decode or colocated EngineWorker actors on Ray.

A launcher only: requests go through the router (router/relay.py is the one prefill -> pull
-> decode orchestration), which also introduces decode workers to prefill workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from kvrelay.common.messages import EngineStats, Role
from kvrelay.engine.args import EngineArgs
from kvrelay.transfer.kv_secret import KVSecret
from kvrelay.worker.actor import EngineWorker
from kvrelay.worker.ray_cluster import join_ray_cluster
from kvrelay.worker.ray_options import start_local_ray

logger = logging.getLogger(__name__)


def worker_num_gpus(device: str, cluster_gpus: float) -> float:
    """GPUs a worker asks Ray for: one for a CUDA device, and for `auto` when the cluster has
    any (Ray then shows the actor that one GPU alone, as `cuda`/`cuda:0`); none for the CPU."""
    if device.startswith("cuda"):
        return 1
    if device == "auto":
        return 1 if cluster_gpus > 0 else 0
    return 0


def actor_engine_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """The engine args as the actor must see them: Ray gives a GPU actor one GPU of its
    choosing and shows it that GPU alone (CUDA_VISIBLE_DEVICES), as `cuda`; a `cuda:N` asked
    here would name a GPU the actor cannot see."""
    device = str(engine_args.get("device", "auto"))
    if not device.startswith("cuda:"):
        return engine_args
    logger.warning("--device %s under Ray: Ray picks each worker's GPU; using 'cuda'", device)
    return {**engine_args, "device": "cuda"}


def spawn_worker(
    engine_args: dict[str, Any],
    role: Role | str,
    transfer_backend: str = "auto",
    num_threads: int = 1,
    *,
    num_cpus: float = 0,
    name: str | None = None,
    namespace: str | None = None,
    resources: dict[str, float] | None = None,
    node_id: str | None = None,
    kv_secret: KVSecret | None = None,
) -> Any:
    """Start one EngineWorker actor; a `name` makes it a detached, named actor that outlives
    its creator (found again by name), `node_id` pins it to a node. `kv_secret`: the
    deployment's KV secret (None: the worker reads it from its own environment)."""
    import ray

    # Supervision: Ray restarts a worker whose process died (kill -9, OOM) with the same
    # arguments, and the router's registry re-adopts it as a new engine (its old blocks and
    # leases died with it). Calls in flight fail at once (max_task_retries 0): the router
    # retries or migrates them, it does not wait for the restart.
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": -1}
    # No Ray task events for the workers' calls: Ray's GCS keeps each call's events (~4 KiB;
    # up to 100,000 calls by default), so with ~2 calls a request its RSS grew ~85 MiB/h in
    # a soak (issue 41). Ray's state API and dashboard then list no worker calls.
    options["enable_task_events"] = False
    device = str(engine_args.get("device", "auto"))
    cluster_gpus = ray.cluster_resources().get("GPU", 0) if device == "auto" else 0
    options["num_gpus"] = worker_num_gpus(device, cluster_gpus)
    if name is not None:
        options.update(name=name, namespace=namespace, lifetime="detached")
    if resources:
        options["resources"] = resources
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    actor = ray.remote(EngineWorker).options(**options)
    # The secret goes as an argument, not a runtime_env variable: Ray's state API and
    # dashboard list an actor's runtime_env, not its arguments.
    return actor.remote(
        actor_engine_args(engine_args), Role(role).value, transfer_backend, num_threads, None,
        kv_secret, own_process=True,
    )  # fmt: skip


class Pools:
    """Worker actors by role; build with `Pools.start`, stop with `shutdown`."""

    def __init__(self, workers: dict[Role, list[Any]], owns_ray: bool) -> None:
        self.by_role = {role: list(workers.get(role, [])) for role in Role}
        self._owns_ray = owns_ray

    @property
    def prefill_workers(self) -> list[Any]:
        return self.by_role[Role.PREFILL]

    @property
    def decode_workers(self) -> list[Any]:
        return self.by_role[Role.DECODE]

    @property
    def colocated_workers(self) -> list[Any]:
        return self.by_role[Role.BOTH]

    @property
    def workers(self) -> list[Any]:
        return [worker for role in Role for worker in self.by_role[role]]

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
        kv_secret: KVSecret | None = None,
    ) -> Pools:
        """Start Ray (unless it is up; `address` joins an existing cluster; else a one-node
        cluster on loopback, ray_options.py) and the workers,
        and wait until every one is healthy. `colocated` starts `num_decode` colocated
        ("both") workers and no prefill pool. `kv_secret`: the KV transfer secret all these
        workers share (default: the environment's, else a new random one for this deployment)."""
        import ray

        owns_ray = False
        if not ray.is_initialized():
            if address is None:
                start_local_ray(num_cpus=os.cpu_count())
            else:
                join_ray_cluster(address)
            owns_ray = True
        args = dataclasses.asdict(EngineArgs.from_kwargs(model, dict(engine_kwargs or {})))
        secret = kv_secret or KVSecret.from_env() or KVSecret.generate()

        def spawn(role: Role, count: int) -> list[Any]:
            return [
                spawn_worker(
                    args,
                    role,
                    transfer_backend,
                    num_threads,
                    num_cpus=num_cpus_per_worker,
                    kv_secret=secret,
                )
                for _ in range(count)
            ]

        if colocated:
            pools = cls({Role.BOTH: spawn(Role.BOTH, num_decode)}, owns_ray)
        else:
            workers = {Role.PREFILL: spawn(Role.PREFILL, num_prefill)}
            workers[Role.DECODE] = spawn(Role.DECODE, num_decode)
            pools = cls(workers, owns_ray)
        ray.get([worker.health.remote() for worker in pools.workers])
        return pools

    def stats(self) -> list[EngineStats]:
        import ray

        return ray.get([worker.stats.remote() for worker in self.workers])

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            try:
                ray.get(worker.shutdown.remote(), timeout=30)
            except Exception:
                logger.warning("a worker did not shut down cleanly", exc_info=True)
            ray.kill(worker)
        self.by_role = {role: [] for role in Role}
        if self._owns_ray:
            ray.shutdown()
