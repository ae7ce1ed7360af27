"""Finding workers on a Ray cluster the router joined, and keeping the pools at size.

Workers are named, detached actors in the `kvrelay` namespace (`kvrelay-<role>-<id>`), so a
restarted router finds the same workers again. Two ways they come to be:
- `kvrelay worker --role R` on a node starts one there (multi-node deployments by hand);
- a router with `--manage-workers` keeps one worker per unit of the Ray custom resource
  `kvrelay_<role>` (on Kubernetes, each KubeRay worker pod of group R offers one), so scaling a
  worker group scales the pool.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from kvrelay.messages import Role

logger = logging.getLogger(__name__)

NAMESPACE = "kvrelay"


def worker_name(role: str) -> str:
    return f"kvrelay-{role}-{uuid.uuid4().hex[:8]}"


def resource_name(role: str) -> str:
    return f"kvrelay_{role}"


def _named_workers() -> dict[str, list[str]]:
    """Names of the live worker actors, by role."""
    import ray

    by_role: dict[str, list[str]] = {role.value: [] for role in Role}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if namespace != NAMESPACE or not name.startswith("kvrelay-"):
            continue
        role = name.split("-")[1]
        if role in by_role:
            by_role[role].append(name)
    return by_role


async def discover_workers() -> Sequence[Any]:
    """Handles of every named worker actor on the cluster."""
    import ray

    names = await asyncio.to_thread(_named_workers)
    handles = []
    for role_names in names.values():
        for name in role_names:
            try:
                handles.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                continue  # it died between the listing and now
    return handles


class WorkerManager:
    """Keeps one worker actor per unit of each `kvrelay_<role>` resource in the cluster."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        transfer_backend: str = "auto",
        num_threads: int = 1,
        roles: Sequence[str] = ("prefill", "decode"),
    ) -> None:
        self.engine_args = engine_args
        self.transfer_backend = transfer_backend
        self.num_threads = num_threads
        self.roles = tuple(roles)

    def reconcile(self) -> dict[str, int]:
        """Start the workers missing from each pool; returns how many were started.

        Worker i of a pool is always named `kvrelay-<role>-<i>`: two routers reconciling at
        once try to create the same names, and Ray lets only one of them succeed.
        """
        import ray

        # Imported here: the worker module loads torch and the engine, which a router that
        # does not start workers never needs.
        from kvrelay.worker.pools import spawn_worker

        started: dict[str, int] = {}
        resources = ray.cluster_resources()
        live = {name for names in _named_workers().values() for name in names}
        for role in self.roles:
            want = int(resources.get(resource_name(role), 0))
            started[role] = 0
            for index in range(want):
                name = f"kvrelay-{role}-{index}"
                if name in live:
                    continue
                try:
                    spawn_worker(
                        self.engine_args,
                        role,
                        self.transfer_backend,
                        self.num_threads,
                        name=name,
                        namespace=NAMESPACE,
                        resources={resource_name(role): 1},
                    )
                except ValueError:  # another router created it first
                    continue
                started[role] += 1
            if started[role]:
                logger.info("started %d %s worker(s) (%d wanted)", started[role], role, want)
        return started

    async def run(self, interval_s: float = 5.0) -> None:
        while True:
            try:
                await asyncio.to_thread(self.reconcile)
            except Exception:
                logger.exception("could not reconcile the worker pools")
            await asyncio.sleep(interval_s)
