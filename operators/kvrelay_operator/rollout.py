"""The API side of a Rolling upgrade: observe both revisions' worker groups, resize the old
revision's RayCluster, report a roll that stopped moving (the Progressing condition and a
Warning Event) and roll back. The decisions are rolling.py's; reconcile.py sequences this.

The old RayCluster is re-applied from what the API server holds, with only its group sizes
changed: it was rendered from an older spec (or an older operator), which the operator no
longer has, and rendering it from the new spec would change its pods under it.

`status.rollout` keeps the roll's state, so a restarted operator carries on (its `trigger`
says whether a spec edit or the operator's default image started it; a default-image roll
may first be `Waiting` its turn, default_gate.py):
    Rolling     the old revision serves; the new one grows within the surge budget
    Switched    the routers serve the new revision; the old RayCluster goes once no router
                pod of its revision is left (revision.clusters_to_retire). A BlueGreen
                upgrade is here from its start: its new revision not turning ready by the
                deadline is reported the same way (its rollback: put the spec back)
    Complete    one revision left
    RolledBack  past the deadline with `autoRollback`: the old revision is scaled back to the
                pools' sizes and the new RayCluster deleted, until the spec is edited again
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay_operator.autoscale import parse_rfc3339, rfc3339
from kvrelay_operator.drain import Step
from kvrelay_operator.errors import PermanentError, RetryableError
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import (
    API_VERSION,
    POOLS,
    SERVICE_KIND,
    component_selector,
    pool_selector,
    raycluster_name,
)
from kvrelay_operator.podparts import Obj
from kvrelay_operator.pool_steps import RAY, group_sizes
from kvrelay_operator.revision import revision_of
from kvrelay_operator.rolling import Side, capped_growth, plan_roll, progress_mark
from kvrelay_operator.spec import ServiceSpec

log = logging.getLogger(__name__)

ROLLING, SWITCHED, COMPLETE, ROLLED_BACK = "Rolling", "Switched", "Complete", "RolledBack"
# status.rollout's fields (schema_upgrade.py); each is written, null where unused, so that a
# merge patch drops what an earlier phase left (a rolled-back roll's specGeneration...).
ROLLOUT_FIELDS = (
    "from",
    "to",
    "phase",
    "newGroups",
    "progressMark",
    "progressAt",
    "specGeneration",
    "message",
    "trigger",
    "queuedAt",
)


def rollout_status(record: Mapping[str, Any]) -> Obj:
    """`record` as the status patch writes it: every field, None where it has none."""
    return {key: record.get(key) for key in ROLLOUT_FIELDS}


def serving_revision(
    kube: Kube, spec: ServiceSpec, previous: Mapping[str, Any], target: str
) -> str:
    """The revision the routers serve: the previous one while a Rolling upgrade replaces it
    (its RayCluster still exists), else the spec's."""
    before = str(previous.get("generation") or "")
    if not spec.upgrade.rolling or not before or before == target:
        return target
    if kube.get(*RAY, spec.namespace, raycluster_name(spec.name, before)) is None:
        return target
    return before


def _scheduled_nowhere(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in conditions
    )


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    conditions = status.get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def observe_side(kube: Kube, spec: ServiceSpec, revision: str) -> Side:
    """One revision's worker groups and pods (zeros where its RayCluster does not exist)."""
    cluster = kube.get(*RAY, spec.namespace, raycluster_name(spec.name, revision))
    groups = group_sizes(cluster)
    sizes: dict[str, dict[str, int]] = {"ready": {}, "alive": {}, "unschedulable": {}}
    for pool in POOLS:
        selector = pool_selector(spec.name, pool, revision)
        pods = [
            p
            for p in kube.list("v1", "Pod", spec.namespace, selector)
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        sizes["alive"][pool] = len(pods)
        sizes["ready"][pool] = sum(_ready(p) for p in pods)
        sizes["unschedulable"][pool] = sum(_scheduled_nowhere(p) for p in pods)
    return Side(
        groups={pool: groups.get(pool, 0) for pool in POOLS},
        ready=sizes["ready"],
        alive=sizes["alive"],
        unschedulable=sizes["unschedulable"],
    )


def resized_cluster(live: Mapping[str, Any], steps: Mapping[str, Step]) -> Obj:
    """An apply body of the RayCluster `live` with each worker group at its step's size and
    the drained pods named; every other field as the API server holds it."""
    meta = live["metadata"]
    body: Obj = {
        "apiVersion": live["apiVersion"],
        "kind": live["kind"],
        "metadata": {
            k: copy.deepcopy(meta[k])
            for k in ("name", "namespace", "labels", "annotations", "ownerReferences")
            if k in meta
        },
        "spec": copy.deepcopy(live["spec"]),
    }
    for group in body["spec"].get("workerGroupSpecs") or ():
        step = steps.get(str(group["groupName"]))
        if step is None:
            continue
        group["replicas"] = step.group_replicas
        group["maxReplicas"] = max(int(group.get("maxReplicas", 0)), step.group_replicas)
        if step.workers_to_delete:
            group["scaleStrategy"] = {"workersToDelete": list(step.workers_to_delete)}
        else:
            group.pop("scaleStrategy", None)
    return body


@dataclass(frozen=True)
class RollOutcome:
    """What a reconcile does for a Rolling upgrade in progress."""

    serving: str  # the routers' revision once this reconcile is applied
    old_wanted: dict[str, int]  # the old revision's pool sizes (drained toward)
    new_groups: dict[str, int] | None  # the new RayCluster's sizes; None: not wanted
    record: Obj  # status.rollout
    condition: Obj  # Progressing
    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message


def held_back(previous: Mapping[str, Any], spec: ServiceSpec, target: str) -> bool:
    """Whether `target` was rolled back and the spec not edited since."""
    record = previous.get("rollout") or {}
    return (
        record.get("phase") == ROLLED_BACK
        and record.get("to") == target
        and int(record.get("specGeneration", -1)) >= spec.generation
    )


def _shrinking_to(old: Side, previous: Mapping[str, Any]) -> Side:
    """The old side with each group at the size its shrink in progress is heading for: the
    group keeps its size while its pods drain (drain.py), but the roll already counts on it."""
    records = previous.get("scaleDown") or {}
    groups = {
        pool: int(records[pool]["replicas"]) if records.get(pool) else old.groups[pool]
        for pool in POOLS
    }
    return dataclasses.replace(old, groups=groups)


def _condition(status: bool, reason: str, message: str) -> Obj:
    return {
        "type": "Progressing",
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:1000],
    }


def _stay_rolled_back(record: Mapping[str, Any], wanted: Mapping[str, int]) -> RollOutcome:
    message = (
        f"rolled back from {record.get('to')}: {record.get('message', '')}; free room (or "
        "raise the pools' nodes) and edit the spec to try again"
    )
    return RollOutcome(
        serving=str(record.get("from")),
        old_wanted=dict(wanted),
        new_groups=None,
        record=dict(record),
        condition=_condition(False, ROLLED_BACK, message),
    )


def plan_rollout(
    kube: Kube,
    spec: ServiceSpec,
    previous: Mapping[str, Any],
    revisions: tuple[str, str],
    wanted: Mapping[str, int],
    now: float,
) -> RollOutcome:
    """The next step of the Rolling upgrade from `revisions` (serving, target).

    Args:
        previous: the service's status now.
        wanted: each pool's size.
        now: epoch seconds.
    """
    serving, target = revisions
    if held_back(previous, spec, target):
        return _stay_rolled_back(previous["rollout"], wanted)
    old, new = (
        _shrinking_to(observe_side(kube, spec, serving), previous),
        observe_side(kube, spec, target),
    )
    draining = any((previous.get("scaleDown") or {}).values())
    step = plan_roll(wanted, old, new, spec.upgrade.max_surge, draining)
    mark = progress_mark(old, new)
    before = previous.get("rollout") or {}
    same = before.get("from") == serving and before.get("to") == target
    since = parse_rfc3339(before.get("progressAt")) if same else None
    progress_at = now if since is None or before.get("progressMark") != mark else since
    record: Obj = {"from": serving, "to": target, "progressMark": mark}
    record["progressAt"] = rfc3339(progress_at)
    stuck = not step.switch and now - progress_at >= spec.upgrade.progress_deadline_s
    why = step.waiting or "waiting for the new revision's workers"
    if stuck and spec.upgrade.auto_rollback:
        record.update(phase=ROLLED_BACK, specGeneration=spec.generation, message=why)
        outcome = _stay_rolled_back(record, wanted)
        events = [("Warning", "RolledBack", f"{target} rolled back to {serving}: {why}")]
        return dataclasses.replace(outcome, events=events)
    record.update(phase=SWITCHED if step.switch else ROLLING, newGroups=step.new_groups)
    record["message"] = step.waiting
    if stuck:
        message = (
            f"{target} made no progress for {spec.upgrade.progress_deadline_s}s: {why}; "
            "set spec.upgrade.autoRollback: true to roll back, or free room"
        )
        condition = _condition(False, "ProgressDeadlineExceeded", message)
        events = [("Warning", "ProgressDeadlineExceeded", message)]
    else:
        reason = "RoutersSwitched" if step.switch else "RollingUpdate"
        condition = _condition(True, reason, f"{serving} -> {target}: {mark}. {step.waiting}")
        events = []
    return RollOutcome(
        serving=target if step.switch else serving,
        old_wanted=step.old_wanted,
        new_groups=step.new_groups,
        record=record,
        condition=condition,
        events=events,
    )


def other_clusters(kube: Kube, spec: ServiceSpec, revision: str) -> list[dict[str, Any]]:
    clusters = kube.list(*RAY, spec.namespace, component_selector(spec.name, "ray"))
    return [c for c in clusters if revision_of(c) != revision]


@dataclass(frozen=True)
class Settling:
    """The routers serve the spec's revision: its group sizes, and the rollout record,
    condition and events (None and none when no upgrade ever ran)."""

    sizes: dict[str, int]
    record: Obj | None = None
    condition: Obj | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)


def after_switch(
    kube: Kube,
    spec: ServiceSpec,
    previous: Mapping[str, Any],
    target: str,
    wanted: Mapping[str, int],
    now: float,
) -> Settling:
    """Once the routers serve `target` (the spec's revision), older RayClusters may remain:
    until they go, a Rolling service grows only within its surge budget, and a new revision
    that stops turning ready (either strategy: BlueGreen's second copy may find no room) is
    reported past the deadline."""
    others = other_clusters(kube, spec, target)
    sizes = dict(wanted)
    if others and spec.upgrade.rolling:
        groups = group_sizes(kube.get(*RAY, spec.namespace, raycluster_name(spec.name, target)))
        held = sum(_held_pods(kube, spec, revision_of(c)) for c in others)
        current = {pool: groups.get(pool, 0) for pool in POOLS}
        sizes = capped_growth(wanted, current, held, spec.upgrade.max_surge)
    before = previous.get("rollout") or {}
    origin = before.get("from") if before.get("to") == target else before.get("to")
    if not others:
        if not before:
            return Settling(sizes)
        record = {**before, "phase": COMPLETE, "to": target, "from": origin, "message": ""}
        return Settling(
            sizes, record, _condition(True, "NewRevisionAvailable", f"serving {target}")
        )
    new = observe_side(kube, spec, target)
    ready = sum(new.ready.values())
    mark = f"new ready {ready}"
    same = before.get("to") == target and before.get("progressMark") == mark
    since = parse_rfc3339(before.get("progressAt")) if same else None
    progress_at = now if since is None else since
    record = {
        **before,
        "from": origin or revision_of(others[0]),
        "to": target,
        "phase": SWITCHED,
        "progressMark": mark,
        "progressAt": rfc3339(progress_at),
        "message": "",
    }
    if ready < sum(wanted.values()) and now - progress_at >= spec.upgrade.progress_deadline_s:
        message = _settling_stuck(spec, target, ready, sum(wanted.values()))
        condition = _condition(False, "ProgressDeadlineExceeded", message)
        return Settling(
            sizes, record, condition, [("Warning", "ProgressDeadlineExceeded", message)]
        )
    message = f"routers on {target}; {len(others)} older RayCluster(s) go once their routers do"
    return Settling(sizes, record, _condition(True, "RetiringOldRevision", message))


def _settling_stuck(spec: ServiceSpec, target: str, ready: int, wanted: int) -> str:
    advice = (
        "free room, or put the spec back to roll back"
        if spec.upgrade.rolling
        else "BlueGreen needs room for both copies: free room, use strategy Rolling, or put "
        "the spec back to roll back (the old routers serve until the new ones are ready)"
    )
    return (
        f"{target} made no progress for {spec.upgrade.progress_deadline_s}s: {ready}/{wanted} "
        f"new workers ready; {advice}"
    )


def _held_pods(kube: Kube, spec: ServiceSpec, revision: str) -> int:
    side = observe_side(kube, spec, revision)
    return sum(side.held(pool) for pool in POOLS)


def event(spec: ServiceSpec, type_: str, reason: str, message: str, now: float, key: str) -> Obj:
    """A core/v1 Event on the service; its name is fixed per (reason, key), so the same
    condition is one Event, not one per reconcile (a second create is a 409, ignored)."""
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{spec.name}.{reason.lower()}-{key[:8]}",
            "namespace": spec.namespace,
        },
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": SERVICE_KIND,
            "name": spec.name,
            "namespace": spec.namespace,
            "uid": spec.uid,
        },
        "type": type_,
        "reason": reason,
        "message": message[:1000],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "source": {"component": "kvrelay-operator"},
        "reportingComponent": "kvrelay-operator",
    }


def emit(
    kube: Kube, spec: ServiceSpec, events: Iterable[tuple[str, str, str]], now: float, key: str
) -> None:
    """Post `events` on the service. An Event is a notice, the status holds the same: one
    that cannot be posted (no rights, a server hiccup) is logged and the reconcile goes on."""
    for type_, reason, message in events:
        try:
            kube.create(event(spec, type_, reason, message, now, key))
        except (PermanentError, RetryableError) as exc:
            log.warning(
                "%s/%s: could not post the %s event: %s", spec.namespace, spec.name, reason, exc
            )
