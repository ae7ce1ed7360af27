"""Which image a service with `spec.image` empty renders when the operator's default image
changes, and the cluster-wide gate that rolls such services one at a time.

A `helm upgrade` that changes the operator's default image would otherwise roll every
service that follows it at once. Here a change of revision is classified:

    Spec              the spec's revision differs even rendered with the image the serving
                      revision was rendered with (`status.image.rendered`): a user's edit,
                      never gated
    OperatorDefaults  rendered with that image the spec gives the serving revision back: only
                      the default image moved

and an OperatorDefaults change follows `spec.upgrade.followOperatorDefaults`:

    Immediate   rolls now
    OneAtATime  rolls when no other service in the watched namespaces is mid-roll for the
                same reason (status.rollout.trigger OperatorDefaults, phase Rolling or
                Switched) and none queued before it (phase Waiting, earlier queuedAt, then
                namespace and name); until then it renders the old image (nothing moves)
                and says whom it waits for (Progressing=False, WaitingForOtherUpgrade). A
                service is queued one reconcile before it may start, so two services that
                reconcile together see each other's queue entry and only the first goes.
    Never       renders the old image; status.image.newerDefault names the new one

A roll to the default image that was rolled back (autoRollback past its deadline) holds the
queue too: the next service would meet the same image. Editing that service's spec (pinning
its image, or any edit once the cause is fixed) releases it.

`status.image` records the image the serving revision was rendered with and whether the
spec pinned it; mid-roll it keeps the record of the revision being replaced.

The state is all in the services' statuses, read through the API (a restarted operator
carries on). Must not: gate a spec edit, or decide anything from in-memory state.
A service with no `status.image` (made by an older operator) cannot be classified and
follows the spec as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay_operator.autoscale import rfc3339
from kvrelay_operator.kube import Kube
from kvrelay_operator.names import API_VERSION, SERVICE_KIND
from kvrelay_operator.podparts import Obj
from kvrelay_operator.revision import revision_hash
from kvrelay_operator.spec import ServiceSpec, parse_service
from kvrelay_operator.upgrade import IMMEDIATE, NEVER

SPEC, DEFAULTS = "Spec", "OperatorDefaults"
WAITING = "Waiting"
# Phases of a roll in progress, and of one given up on (rollout.py's names).
IN_PROGRESS = ("Rolling", "Switched")
ROLLED_BACK = "RolledBack"


@dataclass(frozen=True)
class Choice:
    """What this reconcile renders and records.

    spec: the spec to render (the default image, or the old one while held).
    trigger: why its revision differs from the serving one (SPEC or DEFAULTS).
    image: status.image.
    rollout, condition: status.rollout and Progressing while held in the queue, else None.
    """

    spec: ServiceSpec
    trigger: str
    image: Obj
    rollout: Obj | None = None
    condition: Obj | None = None


def _image_status(spec: ServiceSpec, pinned: bool, default_image: str) -> Obj:
    newer = default_image if not pinned and spec.image != default_image else None
    return {"rendered": spec.image, "pinned": pinned, "newerDefault": newer}


def _carried_trigger(previous: Mapping[str, Any], target: str, trigger: str) -> str:
    """A roll keeps the trigger it started with (a restart mid-roll must not reclassify)."""
    record = previous.get("rollout") or {}
    if record.get("to") == target and record.get("trigger"):
        return str(record["trigger"])
    return trigger


def _started(previous: Mapping[str, Any], target: str) -> bool:
    """Whether a roll to `target` is under way (or was rolled back): it carries on."""
    record = previous.get("rollout") or {}
    return record.get("to") == target and record.get("phase") not in (None, WAITING)


def choose(
    kube: Kube,
    body: Mapping[str, Any],
    default_image: str,
    now: float,
    watched: tuple[str, ...] | None,
) -> Choice:
    """Classify the service's change of revision and apply its follow mode (module doc).

    Args:
        body: the service as read (its status holds the image record and the rollout).
        watched: the operator's namespaces; None for all.

    Raises:
        SpecError: the spec is invalid.
    """
    spec = parse_service(body, default_image)
    pinned = bool((body.get("spec") or {}).get("image"))
    previous = body.get("status") or {}
    target, serving = revision_hash(spec), str(previous.get("generation") or "")
    record = previous.get("image") or {}
    old_image = str(record.get("rendered") or "")
    image = _image_status(spec, pinned, default_image)
    plain = Choice(spec, _carried_trigger(previous, target, SPEC), image)
    if pinned or record.get("pinned") or not serving or target == serving:
        return plain
    if not old_image or old_image == default_image or _started(previous, target):
        return plain
    held = parse_service(body, old_image)
    if revision_hash(held) != serving:
        return plain  # the user's edit: never gated
    follow = Choice(spec, DEFAULTS, image)
    mode = spec.upgrade.follow_defaults
    if mode == IMMEDIATE:
        return follow
    held_image = _image_status(held, False, default_image)
    if mode == NEVER:
        return Choice(held, SPEC, held_image)
    blocker = _blocker(kube, body, watched)
    if not blocker and (previous.get("rollout") or {}).get("phase") == WAITING:
        return follow
    queued = _queued(previous, serving, target, now, blocker or "queued: starts next reconcile")
    return Choice(held, DEFAULTS, held_image, *queued)


def _queued(
    previous: Mapping[str, Any], serving: str, target: str, now: float, why: str
) -> tuple[Obj, Obj]:
    before = previous.get("rollout") or {}
    since = before.get("queuedAt") if before.get("phase") == WAITING else None
    record = {
        "from": serving,
        "to": target,
        "phase": WAITING,
        "trigger": DEFAULTS,
        "queuedAt": since or rfc3339(now),
        "message": why,
    }
    condition = {
        "type": "Progressing",
        "status": "False",
        "reason": "WaitingForOtherUpgrade",
        "message": f"the operator's new default image waits its turn: {why}"[:1000],
    }
    return record, condition


def _key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    queued = str(((obj.get("status") or {}).get("rollout") or {}).get("queuedAt") or "")
    return queued, str(meta.get("namespace")), str(meta.get("name"))


def _blocker(kube: Kube, body: Mapping[str, Any], watched: tuple[str, ...] | None) -> str:
    """Why this service may not start its OperatorDefaults roll now, "" when it may."""
    me = _key(body)
    others = [
        obj
        for obj in kube.list_everywhere(API_VERSION, SERVICE_KIND, watched)
        if _key(obj)[1:] != me[1:]
    ]
    ahead = []
    for obj in others:
        record = (obj.get("status") or {}).get("rollout") or {}
        if record.get("trigger") != DEFAULTS:
            continue
        name = "/".join(_key(obj)[1:])
        if record.get("phase") in IN_PROGRESS:
            return f"{name} is rolling to the operator's default image"
        if record.get("phase") == ROLLED_BACK:
            # The default image did not come up there: the next service would fare the same.
            return (
                f"{name}'s roll to the operator's default image was rolled back; edit its "
                "spec (or pin its image) once the cause is fixed to let the others follow"
            )
        if record.get("phase") == WAITING and me[0] and _key(obj) < me:
            ahead.append(name)
    return f"{ahead[0]} was queued first" if ahead else ""
