"""Drain before shrink: which worker pods a pool loses, and when KubeRay may delete them.

Left to itself, KubeRay shrinks a worker group by deleting pods of its own choosing, with
the requests on them. Instead a shrink goes through three steps, one per reconcile, level
based (the state lives in the service's `status.scaleDown`, so a restarted or newly elected
operator carries on):

    no record, the pool wants fewer workers than its group has
        -> pick the pods to remove (`pick_pods`), ask the router to drain them, keep the
           group at its size                                       (phase Draining)
    Draining: every picked worker reports draining with nothing in flight (or its worker is
        gone), or the drain timeout passed (streams then move to other workers when the
        pod dies)
        -> group at the wanted size, the picked pods in scaleStrategy.workersToDelete
                                                                   (phase Deleting)
    Deleting: none of the picked pods exists any more
        -> record cleared, workersToDelete dropped

A pool that grows does so at once. Pure: no I/O, time passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

DRAINING = "Draining"
DELETING = "Deleting"


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the router's `GET /admin/v1/workers` lists it."""

    name: str
    pod: str
    state: str  # "serving" | "draining"
    in_flight: int

    @property
    def drained(self) -> bool:
        return self.state == "draining" and self.in_flight == 0


def parse_workers(payload: Mapping[str, Any]) -> list[WorkerInfo]:
    """The router's worker list.

    Raises:
        ValueError: the payload is not the admin API's shape.
    """
    try:
        return [
            WorkerInfo(
                str(w["name"]), str(w.get("pod") or ""), str(w["state"]), int(w["in_flight"])
            )
            for w in payload["workers"]
        ]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a worker list: {exc}") from exc


@dataclass(frozen=True)
class PodInfo:
    """A worker pod of the serving revision's group, as the kopf layer saw it."""

    name: str
    ready: bool = True
    terminating: bool = False
    created: str = ""  # RFC 3339: sorts in time order


@dataclass(frozen=True)
class ScaleDown:
    """A shrink in progress (the status' `scaleDown.<pool>`)."""

    pods: tuple[str, ...]
    replicas: int  # the group's size once they are gone
    from_: int  # its size before
    phase: str
    started_at: float  # epoch seconds

    def to_status(self, rfc3339: str) -> dict[str, Any]:
        return {
            "pods": list(self.pods),
            "replicas": self.replicas,
            "from": self.from_,
            "phase": self.phase,
            "startedAt": rfc3339,
        }

    @staticmethod
    def from_status(raw: Mapping[str, Any] | None, started_at: float | None) -> ScaleDown | None:
        if not raw or not raw.get("pods"):
            return None
        return ScaleDown(
            pods=tuple(str(p) for p in raw["pods"]),
            replicas=int(raw.get("replicas", 0)),
            from_=int(raw.get("from", 0)),
            phase=str(raw.get("phase", DRAINING)),
            started_at=0.0 if started_at is None else started_at,
        )


@dataclass(frozen=True)
class Step:
    """What this reconcile does for one pool."""

    group_replicas: int  # the worker group's replicas to apply
    workers_to_delete: tuple[str, ...] = ()
    record: ScaleDown | None = None  # the new status; None clears it
    drain: tuple[str, ...] = ()  # pods to ask the router to drain now


def pick_pods(
    pods: Sequence[PodInfo], workers: Sequence[WorkerInfo] | None, count: int
) -> list[str]:
    """The `count` pods a shrink removes: not-ready pods first (they serve nothing), then
    those with the fewest requests in flight, then the newest (least warm prefix cache);
    names break ties so the choice is stable across reconciles."""
    load: dict[str, int] = {}
    for worker in workers or ():
        load[worker.pod] = load.get(worker.pod, 0) + worker.in_flight
    by_age = sorted(pods, key=lambda p: p.created, reverse=True)
    age_rank = {p.name: i for i, p in enumerate(by_age)}
    candidates = [p for p in pods if not p.terminating]
    ordered = sorted(
        candidates, key=lambda p: (p.ready, load.get(p.name, 0), age_rank[p.name], p.name)
    )
    return [p.name for p in ordered[:count]]


def _drained(record: ScaleDown, workers: Sequence[WorkerInfo] | None) -> bool:
    if workers is None:  # the router did not answer: only the timeout ends the drain
        return False
    for pod in record.pods:
        on_pod = [w for w in workers if w.pod == pod]
        if not all(w.drained for w in on_pod):
            return False
    return True


def next_step(
    wanted: int,
    group: int | None,
    record: ScaleDown | None,
    pods: Sequence[PodInfo],
    workers: Sequence[WorkerInfo] | None,
    now: float,
    timeout_s: float,
) -> Step:
    """One pool's step toward `wanted` workers.

    Args:
        wanted: the KVRelayPool's replicas.
        group: the serving revision's worker group replicas now; None when its RayCluster
            does not exist yet.
        record: the shrink in progress, if any.
        pods: the group's pods (terminating ones included).
        workers: the router's worker list, None when it could not be read.
        now: epoch seconds.
        timeout_s: the pool's drain timeout.
    """
    if record is None:
        return _start(wanted, group, pods, workers, now)
    if record.phase == DELETING:
        remaining = {p.name for p in pods} & set(record.pods)
        if not remaining:
            return Step(group_replicas=wanted)
        return Step(wanted, record.pods, replace(record, replicas=wanted))
    if wanted < record.replicas:  # shrinking further while draining: drain more pods
        others = [p for p in pods if p.name not in record.pods]
        more = pick_pods(others, workers, record.replicas - wanted)
        record = replace(record, pods=record.pods + tuple(more), replicas=wanted)
    if _drained(record, workers) or now - record.started_at >= timeout_s:
        deleting = replace(record, phase=DELETING, replicas=wanted)
        return Step(wanted, record.pods, deleting)
    return Step(max(record.from_, wanted), (), record, record.pods)


def _start(
    wanted: int,
    group: int | None,
    pods: Sequence[PodInfo],
    workers: Sequence[WorkerInfo] | None,
    now: float,
) -> Step:
    if group is None or wanted >= group:
        return Step(group_replicas=wanted)
    alive = [p for p in pods if not p.terminating]
    count = len(alive) - wanted
    if count <= 0:  # the pods to lose were never created: nothing to drain
        return Step(group_replicas=wanted)
    chosen = tuple(pick_pods(alive, workers, count))
    record = ScaleDown(chosen, wanted, group, DRAINING, now)
    return Step(group, (), record, chosen)
