"""A toy cluster around the fake API server, for upgrade tests: what KubeRay, the scheduler,
the router Deployment and clients would do between two reconciles.

- KubeRay: each RayCluster worker group gets pods up to its replicas; a shrink deletes the
  pods named in `scaleStrategy.workersToDelete`, else (counted as a defect: it may cut a
  stream) the newest; a deleted RayCluster's pods go.
- The scheduler: `slots` worker pods fit the nodes; a pod beyond them is Pending with
  PodScheduled=False/Unschedulable, and is placed (Running, Ready) once a slot frees, oldest
  first. `blocked(revision, pool)` pods never fit (a node selector no node matches).
- The router Deployment: one router pod per revision its template names; a new one is ready
  once its revision has a ready decode worker; the old routers then terminate, and go once
  their streams end (the grace period a real router gets).
- Clients: `arrivals` requests per tick, each streaming for `length` ticks on a decode
  worker (its prefill on a prefill worker the first tick) of a ready router's revision,
  never on a worker the router was told to drain. A request fails when no ready router has
  a decode worker, or when a worker it streams on is deleted.

The router stub is the routers' admin API: its worker list mirrors the serving routers'
workers, with their in-flight counts, and the operator's drains mark them.

Nothing here is in fake_api.py: it only writes objects into the fake's store, as the real
controllers would into the API server.

One sim simulates one service (`service`, "demo" by default) and its own `slots`: several
services in one fake are several sims, each with its own router stub.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.names import REVISION_LABEL, labels
from tests.operator.fake_api import FakeApi
from tests.operator.router_stub import RouterStub

NS = "llm"
PODS = f"/api/v1/namespaces/{NS}/pods"
RAYS = f"/apis/ray.io/v1/namespaces/{NS}/rayclusters"

Obj = dict[str, Any]


@dataclass
class Stream:
    router: str  # the router pod's name
    prefill: str  # "" when decode ran the whole request
    decode: str
    ticks_left: int
    started: bool = False


@dataclass
class ClusterSim:
    api: FakeApi
    router: RouterStub
    slots: int
    arrivals: int = 2
    length: int = 3
    blocked: Callable[[str, str], bool] = lambda revision, pool: False
    streams: list[Stream] = field(default_factory=list)
    arrived: int = 0
    served: int = 0
    failed: list[str] = field(default_factory=list)
    random_deletions: list[str] = field(default_factory=list)
    clock: int = 0
    service: str = "demo"

    @property
    def deployment(self) -> str:
        return f"/apis/apps/v1/namespaces/{NS}/deployments/{self.service}-router"

    def _ours(self, cluster: str) -> bool:
        """Whether a RayCluster (`<service>-<revision[:8]>`) is this sim's service's."""
        return cluster.rsplit("-", 1)[0] == self.service

    # -- KubeRay and the scheduler -------------------------------------------------------

    def worker_pods(self, cluster: str | None = None, group: str | None = None) -> list[Obj]:
        out = []
        for path, obj in self.api.objects.items():
            if not path.startswith(f"{PODS}/"):
                continue
            pod_labels = obj["metadata"].get("labels") or {}
            if "ray.io/group" not in pod_labels or not self._ours(pod_labels["ray.io/cluster"]):
                continue
            if cluster is not None and pod_labels["ray.io/cluster"] != cluster:
                continue
            if group is not None and pod_labels["ray.io/group"] != group:
                continue
            out.append(obj)
        return sorted(out, key=lambda p: p["metadata"]["creationTimestamp"])

    def _delete_pod(self, name: str) -> None:
        del self.api.objects[f"{PODS}/{name}"]

    def _new_pod(self, cluster: str, group: Obj) -> None:
        self.clock += 1
        name = f"{cluster}-{group['groupName']}-{self.clock}"
        template_labels = group["template"]["metadata"]["labels"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {
                    **template_labels,
                    "ray.io/cluster": cluster,
                    "ray.io/group": group["groupName"],
                },
                "creationTimestamp": f"2026-12-05T00:00:00.{self.clock:06d}Z",
            },
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                ],
            },
        }
        self.api.objects[f"{PODS}/{name}"] = pod

    def _kuberay(self) -> None:
        clusters = {
            path.rsplit("/", 1)[1]: obj
            for path, obj in self.api.objects.items()
            if path.startswith(f"{RAYS}/") and self._ours(path.rsplit("/", 1)[1])
        }
        for pod in self.worker_pods():
            if pod["metadata"]["labels"]["ray.io/cluster"] not in clusters:
                self._delete_pod(pod["metadata"]["name"])
        for name, cluster in clusters.items():
            for group in cluster["spec"]["workerGroupSpecs"]:
                self._size_group(name, group)

    def _size_group(self, cluster: str, group: Obj) -> None:
        pods = self.worker_pods(cluster, group["groupName"])
        named = set((group.get("scaleStrategy") or {}).get("workersToDelete") or ())
        for pod in pods:
            if len(pods) > group["replicas"] and pod["metadata"]["name"] in named:
                self._delete_pod(pod["metadata"]["name"])
                pods.remove(pod)
        while len(pods) > group["replicas"]:
            victim = pods.pop()["metadata"]["name"]
            self.random_deletions.append(victim)
            self._delete_pod(victim)
        for _ in range(group["replicas"] - len(pods)):
            self._new_pod(cluster, group)

    def _schedule(self) -> None:
        pods = self.worker_pods()
        placed = sum(p["status"]["phase"] == "Running" for p in pods)
        for pod in pods:
            if pod["status"]["phase"] == "Running" or placed >= self.slots:
                continue
            pod_labels = pod["metadata"]["labels"]
            if self.blocked(pod_labels[REVISION_LABEL], pod_labels["ray.io/group"]):
                continue
            pod["status"] = {
                "phase": "Running",
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": "True"},
                ],
            }
            placed += 1

    def placed(self) -> int:
        return sum(p["status"]["phase"] == "Running" for p in self.worker_pods())

    # -- the router Deployment -------------------------------------------------------------

    def router_pods(self) -> list[Obj]:
        prefix = f"{PODS}/{self.service}-router-"
        return [obj for path, obj in self.api.objects.items() if path.startswith(prefix)]

    def _ready_workers(self, revision: str, pool: str) -> list[str]:
        return [
            p["metadata"]["name"]
            for p in self.worker_pods(group=pool)
            if p["metadata"]["labels"].get(REVISION_LABEL) == revision
            and p["status"]["phase"] == "Running"
        ]

    def ready_workers(self, revision: str) -> int:
        """Ready worker pods of `revision`, both pools."""
        return sum(len(self._ready_workers(revision, pool)) for pool in ("prefill", "decode"))

    def _routers(self) -> None:
        deployment = self.api.objects.get(self.deployment)
        if deployment is None:
            return
        wanted = deployment["spec"]["template"]["metadata"]["labels"][REVISION_LABEL]
        name = f"{self.service}-router-{wanted[:8]}"
        if f"{PODS}/{name}" not in self.api.objects:
            meta = {
                "name": name,
                "labels": {**labels(self.service, "router"), REVISION_LABEL: wanted},
            }
            self.api.objects[f"{PODS}/{name}"] = {"metadata": meta, "status": {}}
        new_ready = bool(self._ready_workers(wanted, "decode"))
        self.api.objects[f"{PODS}/{name}"]["status"]["ready"] = new_ready
        for pod in self.router_pods():
            meta = pod["metadata"]
            if meta["name"] == name or not new_ready:
                continue
            meta.setdefault("deletionTimestamp", "2026-12-05T00:00:00Z")
            if not any(s.router == meta["name"] for s in self.streams):
                del self.api.objects[f"{PODS}/{meta['name']}"]
        ready = sum(1 for p in self.router_pods() if self._serving_router(p))
        deployment["status"] = {"replicas": len(self.router_pods()), "readyReplicas": ready}

    @staticmethod
    def _serving_router(pod: Obj) -> bool:
        return bool(pod["status"].get("ready")) and "deletionTimestamp" not in pod["metadata"]

    # -- clients and the routers' admin API -------------------------------------------------

    def _sync_admin(self) -> None:
        """The stub lists the serving routers' workers, keeping the drain marks."""
        known = {w["pod"]: w for w in self.router.workers}
        revisions = {
            p["metadata"]["labels"][REVISION_LABEL]
            for p in self.router_pods()
            if "deletionTimestamp" not in p["metadata"]
        }
        listed = []
        for pool in ("prefill", "decode"):
            for revision in revisions:
                for pod in self._ready_workers(revision, pool):
                    worker = known.get(pod) or {
                        "name": f"kvrelay-{pool}-{pod}",
                        "role": pool,
                        "pod": pod,
                        "node": "node-1",
                        "generation": revision,
                        "state": "serving",
                    }
                    worker["in_flight"] = sum(
                        1 for s in self.streams if pod in (s.decode, s.prefill)
                    )
                    listed.append(worker)
        self.router.workers = listed

    def _pick(self, revision: str, pool: str) -> str:
        draining = {w["pod"] for w in self.router.workers if w["state"] == "draining"}
        pods = [p for p in self._ready_workers(revision, pool) if p not in draining]
        if not pods:
            return ""
        load = {p: sum(1 for s in self.streams if p in (s.decode, s.prefill)) for p in pods}
        return min(pods, key=lambda p: (load[p], p))

    def _traffic(self) -> None:
        alive = {p["metadata"]["name"] for p in self.worker_pods()}
        for stream in list(self.streams):
            uses = {stream.decode} | ({stream.prefill} if not stream.started else set())
            if not uses <= alive:
                self.failed.append(f"cut mid-stream on {sorted(uses - alive)}")
                self.streams.remove(stream)
                continue
            stream.started = True
            stream.ticks_left -= 1
            if stream.ticks_left == 0:
                self.served += 1
                self.streams.remove(stream)
        routers = [p for p in self.router_pods() if self._serving_router(p)]
        for _ in range(self.arrivals):
            self._arrive(routers)

    def _arrive(self, routers: list[Obj]) -> None:
        self.arrived += 1
        for router in routers:
            revision = router["metadata"]["labels"][REVISION_LABEL]
            decode = self._pick(revision, "decode")
            if decode:
                prefill = self._pick(revision, "prefill")
                name = router["metadata"]["name"]
                self.streams.append(Stream(name, prefill, decode, self.length))
                return
        self.failed.append("no router with a decode worker")

    def tick(self) -> None:
        """What the cluster does between two reconciles."""
        self._kuberay()
        self._schedule()
        self._routers()
        self._traffic()
        self._sync_admin()
