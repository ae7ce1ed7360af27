"""Finding workers on a Ray cluster the router joined, and keeping the pools at size.

Workers are named, detached actors in the `kvrelay` namespace (`kvrelay-<role>-<pod>`), so a
restarted router finds the same workers again. Two ways they come to be:
- `kvrelay worker --role R` on a node starts one there (multi-node deployments by hand);
- a router with `--manage-workers` keeps one worker on each Ray node that offers the custom
  resource `kvrelay_<role>` (on Kubernetes, each KubeRay worker pod of group R), pinned there,
  so scaling a worker group scales the pool.

Names are per pod, never per index: a pod that KubeRay re-creates has a new name, so its worker
gets a free name at once (an index left a gap after a scale-down, and the re-created
`kvrelay-<role>-0` waited forever for its slot).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.common.env import POD_NAME
from kvrelay.common.messages import Role

logger = logging.getLogger(__name__)

NAMESPACE = "kvrelay"


def worker_name(role: str, environ: Mapping[str, str] | None = None) -> str:
    """The name of a worker `kvrelay worker` starts on this node: per pod on Kubernetes
    ($KVRELAY_POD_NAME), else unique."""
    pod = POD_NAME.get(environ).strip()
    return f"kvrelay-{role}-{_safe(pod) if pod else uuid.uuid4().hex[:8]}"


def _safe(text: str) -> str:
    """`text` as a piece of an actor name (pod names are DNS labels already)."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", text)


@dataclass(frozen=True)
class Slot:
    """Where one managed worker of a pool lives: a Ray node and the actor name it gets."""

    node_id: str
    name: str


def worker_slots(role: str, nodes: Sequence[Mapping[str, Any]]) -> list[Slot]:
    """One slot per live Ray node offering `kvrelay_<role>` (from `ray.nodes()`), named
    `kvrelay-<role>-<host name>`: KubeRay sets a pod's host name to the pod's name. Host names
    that several nodes share (Ray nodes started on one machine) get the node id appended, so
    names stay unique off Kubernetes too."""
    resource = resource_name(role)
    offering = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0]
    hosts = Counter(str(n.get("NodeManagerHostname", "")) for n in offering)
    slots = []
    for node in offering:
        host, node_id = str(node.get("NodeManagerHostname", "")), str(node["NodeID"])
        unique = bool(host) and hosts[host] == 1
        suffix = _safe(host) if unique else f"{_safe(host) or 'node'}-{node_id[:12]}"
        slots.append(Slot(node_id, f"kvrelay-{role}-{suffix}"))
    return slots


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


def _worker_actors() -> list[Any]:
    import ray

    actors = []
    for role_names in _named_workers().values():
        for name in role_names:
            try:
                actors.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                continue  # it died between the listing and now
    return actors


async def discover_workers() -> Sequence[Any]:
    """Handles of every named worker actor on the cluster (Ray's calls to its control store
    block: they run on a thread, so a caller's timeout bounds them)."""
    return await asyncio.to_thread(_worker_actors)


class WorkerManager:
    """Keeps one worker actor on each Ray node offering a `kvrelay_<role>` resource."""

    def __init__(
        self,
        spawn: Callable[..., Any],
        engine_args: dict[str, Any],
        transfer_backend: str = "auto",
        num_threads: int = 1,
        roles: Sequence[str] = ("prefill", "decode"),
    ) -> None:
        """`spawn`: `kvrelay.worker.pools.spawn_worker`, passed in by the command that runs
        the router, so the router's modules never load the worker's (nor torch and the
        engine, which a router that starts no workers never needs)."""
        self.spawn = spawn
        self.engine_args = engine_args
        self.transfer_backend = transfer_backend
        self.num_threads = num_threads
        self.roles = tuple(roles)

    def reconcile(self) -> dict[str, int]:
        """Start the workers missing from each pool; returns how many were started.

        A node's worker is always named after its node (`worker_slots`) and pinned to it: two
        routers reconciling at once try to create the same names, and Ray lets only one of
        them succeed. Ray's calls here are quick control-store reads; `run` runs this on a
        thread so the router's loop never waits on them.
        """
        import ray

        started: dict[str, int] = {}
        nodes = ray.nodes()
        live = {name for names in _named_workers().values() for name in names}
        for role in self.roles:
            slots = worker_slots(role, nodes)
            started[role] = 0
            for slot in slots:
                if slot.name in live:
                    continue
                try:
                    self.spawn(
                        self.engine_args,
                        role,
                        self.transfer_backend,
                        self.num_threads,
                        name=slot.name,
                        namespace=NAMESPACE,
                        resources={resource_name(role): 1},
                        node_id=slot.node_id,
                    )
                except ValueError:  # another router created it first
                    continue
                started[role] += 1
            if started[role]:
                logger.info("started %d %s worker(s) (%d wanted)", started[role], role, len(slots))
        return started

    async def run(self, interval_s: float = 5.0) -> None:
        while True:
            try:
                await asyncio.to_thread(self.reconcile)
            except Exception:
                logger.exception("could not reconcile the worker pools")
            await asyncio.sleep(interval_s)
