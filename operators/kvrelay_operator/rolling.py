"""A Rolling upgrade's next step: how the new revision's worker groups grow, how far the old
revision's shrink, and when the routers move. Pure: no I/O, sizes and pods passed in.

The routers serve one revision (a router drives the RayCluster it is pointed at, and pairs
prefill and decode workers of one revision only), so the old revision serves while the new
one grows beside it, and the routers move once the new one can serve alone:

    budget = the pools' sizes + maxSurge worker pods, both revisions counted (an old pod
             counts until it is gone: a draining or terminating pod still holds its GPU)

    new revision can serve alone (a ready decode worker, and a ready prefill worker unless
        the prefill pool is empty), none of its pods still starting, and it is full or as
        big as the old one                                                  -> switch
    room in the budget, the new revision below its sizes -> grow one new pod, in the pool
        that is empty or furthest behind; nothing beyond one serving pair until that pair
        is ready (a slot freed for one pool must not go to the other's second pod)
    an old drain in progress, or a new pod starting        -> wait (one step at a time)
    at the budget -> drain one old worker, in the pool a new pod waits for room in (an old
        revision keeps one prefill and one decode worker: it serves until the switch)
    nothing left to drain, the new revision can serve      -> switch
    otherwise                                              -> wait (reported; see deadline)

A service of one prefill and one decode worker with maxSurge 0 has nothing to drain and no
room: the budget is raised to hold one new pair beside the old minimum (`budget`), so a
roll never drops a service to no worker; where the cluster has no room for that pair, the
new pods stay Pending, the deadline reports it and a rollback ends it.

Serving capacity through a roll never falls below about half the pools' sizes: the old
revision shrinks one worker per new worker, and the routers move at the crossover.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrelay_operator.names import POOLS

Sizes = Mapping[str, int]


def _zero() -> dict[str, int]:
    return dict.fromkeys(POOLS, 0)


@dataclass(frozen=True)
class Side:
    """One revision's worker groups as observed."""

    groups: Sizes = field(default_factory=_zero)  # worker group replicas
    ready: Sizes = field(default_factory=_zero)  # ready pods
    alive: Sizes = field(default_factory=_zero)  # pods that exist, terminating ones included
    unschedulable: Sizes = field(default_factory=_zero)  # pods with no room (PodScheduled)

    def held(self, pool: str) -> int:
        """Worker slots this side occupies or claims in `pool`."""
        return max(self.groups[pool], self.alive[pool])


@dataclass(frozen=True)
class RollStep:
    new_groups: dict[str, int]  # the new revision's worker group replicas
    old_wanted: dict[str, int]  # the old revision's pool sizes (drain.py shrinks toward them)
    switch: bool = False  # the routers move to the new revision now
    waiting: str = ""  # why nothing moved, "" when something did


def serving_pair(wanted: Sizes) -> dict[str, int]:
    """The workers a revision needs to serve alone: a decode worker, and a prefill worker
    unless the prefill pool is empty (decode then runs whole requests)."""
    return {pool: 1 if wanted[pool] > 0 else 0 for pool in POOLS}


def old_minimum(old: Side) -> dict[str, int]:
    """What the old revision keeps while it serves: one worker of each pool it has."""
    return {pool: min(1, old.groups[pool]) for pool in POOLS}


def budget(wanted: Sizes, old: Side, max_surge: int) -> int:
    """Worker pods both revisions may hold together: the pools' sizes plus the surge, and
    never less than the old minimum plus one new serving pair."""
    floor = sum(old_minimum(old).values()) + sum(serving_pair(wanted).values())
    return max(sum(wanted.values()) + max_surge, floor)


def can_serve(side: Side, wanted: Sizes) -> bool:
    pair = serving_pair(wanted)
    return all(side.ready[pool] >= pair[pool] for pool in POOLS)


def next_pool(wanted: Sizes, groups: Sizes) -> str | None:
    """The pool the new revision grows next: an empty one first (a serving pair comes
    first), else the one furthest behind its size; None when every pool is full."""
    behind = [pool for pool in POOLS if groups[pool] < wanted[pool]]
    if not behind:
        return None
    empty = [pool for pool in behind if groups[pool] == 0]
    if empty:
        return empty[0]
    return max(behind, key=lambda pool: (wanted[pool] - groups[pool]) / wanted[pool])


def _starting(new: Side) -> int:
    """New pods neither ready nor waiting for room (pulling, loading their model)."""
    return sum(new.groups[p] - new.ready[p] - new.unschedulable[p] for p in POOLS)


def _pool_to_drain(old: Side, new: Side, limit: Sizes) -> str | None:
    """The old pool that gives up a worker: where a new pod waits for room, else where the
    new revision grows next (toward `limit`), else any pool above the old minimum."""
    keep = old_minimum(old)
    waiting = [pool for pool in POOLS if new.unschedulable[pool] > 0]
    grow = next_pool(limit, new.groups)
    order = [*waiting, *([grow] if grow else []), *POOLS]
    for pool in order:
        if old.groups[pool] > keep[pool]:
            return pool
    return None


def plan_roll(wanted: Sizes, old: Side, new: Side, max_surge: int, old_draining: bool) -> RollStep:
    """One step of a Rolling upgrade (the module docstring's rules, in order).

    Args:
        wanted: each pool's size (its KVRelayPool's replicas).
        old: the serving revision's groups and pods.
        new: the spec's revision's groups and pods (zeros before its RayCluster exists).
        max_surge: `spec.upgrade.maxSurge`.
        old_draining: an old worker is being drained now.
    """
    new_groups, old_wanted = dict(new.groups), dict(old.groups)
    full = all(new.ready[pool] >= wanted[pool] for pool in POOLS)
    settled = _starting(new) == 0
    crossed = full or sum(new.ready.values()) >= sum(old.groups.values())
    if can_serve(new, wanted) and settled and crossed:
        return RollStep(new_groups, old_wanted, switch=True)
    held = sum(old.held(pool) + new.groups[pool] for pool in POOLS)
    # Until a new pair serves, nothing beyond it: a slot an old drain frees must not go to
    # a second new pod of one pool while the other pool's first one waits.
    limit = wanted if can_serve(new, wanted) else serving_pair(wanted)
    grow = next_pool(limit, new_groups)
    if grow is not None and held < budget(wanted, old, max_surge):
        new_groups[grow] += 1
        return RollStep(new_groups, old_wanted)
    if old_draining:
        return RollStep(new_groups, old_wanted, waiting="an old worker is draining")
    if not settled:
        return RollStep(new_groups, old_wanted, waiting="new workers are starting")
    drain = _pool_to_drain(old, new, limit)
    if drain is not None:
        old_wanted[drain] -= 1
        return RollStep(new_groups, old_wanted)
    if can_serve(new, wanted):
        return RollStep(new_groups, old_wanted, switch=True)
    return RollStep(
        new_groups,
        old_wanted,
        waiting=f"no room for a new serving pair: {_pending(new)}; the old revision is at "
        "its minimum (one worker per pool)",
    )


def _pending(new: Side) -> str:
    waiting = sum(new.unschedulable.values())
    return f"{waiting} new pod(s) unschedulable" if waiting else "new pods not ready"


def capped_growth(wanted: Sizes, groups: Sizes, others: int, max_surge: int) -> dict[str, int]:
    """After the switch, while older revisions' pods still exist (`others` of them): the
    serving revision's group sizes, grown only within the budget. Shrinks pass through."""
    room = sum(wanted.values()) + max_surge - others - sum(groups.values())
    out = {pool: min(wanted[pool], groups[pool]) for pool in POOLS}
    while room > 0:
        pool = next_pool(wanted, out)
        if pool is None:
            break
        out[pool] += 1
        room -= 1
    return out


def progress_mark(old: Side, new: Side) -> str:
    """What moves when a roll progresses: new ready workers up, old workers down."""
    return f"new ready {sum(new.ready.values())}, old {sum(old.groups.values())}"
