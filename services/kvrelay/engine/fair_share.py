"""Weighted fair share of the engine's running batch across tenants: which waiting request is
admitted next, which running one is preempted, and when a waiting request may take a running
one's place. Pure choices over the scheduler's lists: nothing here allocates KV or changes a
request; the scheduler acts on the answers (engine/scheduler.py).

A tenant's *load* is its running sequences divided by its weight (`Request.tenant`,
`Request.weight`, filled by the router from the API key and `--tenant-limits`). A running
leader whose forks (the other samples of an `n` > 1 request) have not joined yet counts them
too: they join at its first token. The scheduler asks only when something waits or KV runs
out, so a step of plain decodes pays nothing for tenants.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

from kvrelay.engine.request import Request

# Order of service (Request.scheduling_key: priority, then arrival), read in C by `sorted`.
SERVICE_ORDER = operator.attrgetter("scheduling_key")
# Read in C by map(): the scheduler asks with up to max_num_seqs running requests every step
# that something waits at a full batch, so these passes stay out of Python bytecode.
_TENANT = operator.attrgetter("tenant")
_WEIGHT = operator.attrgetter("weight")
_PRIORITY = operator.attrgetter("priority")
Forks = Mapping[str, Sequence[Request]]


def num_sequences(request: Request, forks: Forks) -> int:
    """The sequences `request` runs: itself and the forks waiting for its first token."""
    pending = forks.get(request.request_id) if forks else None
    return 1 + len(pending) if pending else 1


def one_tenant(requests: Iterable[Request]) -> bool:
    """Whether every request is the same tenant's (then fairness is today's plain order)."""
    return len(set(map(_TENANT, requests))) <= 1


def worst_of(running: Iterable[Request], tenant: str) -> Request | None:
    """`tenant`'s lowest-priority, newest running request (None: it runs none)."""
    return max((r for r in running if r.tenant == tenant), key=SERVICE_ORDER, default=None)


class Shares:
    """Running sequences and weight of each tenant, counted once from `running`, then kept up
    to date by `add` / `remove` as the scheduler admits and preempts within one step.

    A tenant's weight is the one its requests carry (the router gives every request of a
    tenant the same; just after `--tenant-limits` is reloaded, the one counted last wins).
    """

    def __init__(self, running: Sequence[Request], forks: Forks) -> None:
        self.forks = forks
        self.sequences: Counter[str] = Counter(map(_TENANT, running))
        self.weights: dict[str, float] = dict(
            zip(map(_TENANT, running), map(_WEIGHT, running), strict=True)
        )
        if forks:  # a running leader's forks join at its first token: count them now
            running_ids = {r.request_id for r in running}
            for leader_id, pending in forks.items():
                if pending and leader_id in running_ids:
                    self.sequences[pending[0].tenant] += len(pending)

    def load(self, tenant: str) -> float:
        return self.sequences[tenant] / self.weights.get(tenant, 1.0)

    def add(self, request: Request) -> None:
        self.sequences[request.tenant] += num_sequences(request, self.forks)
        self.weights[request.tenant] = request.weight

    def remove(self, request: Request) -> None:
        self.sequences[request.tenant] -= num_sequences(request, self.forks)

    def most_loaded(self, running: Sequence[Request], exclude: str | None = None) -> str | None:
        """The running tenant most over its share (highest load), `exclude` left out; of
        equal loads, the one whose lowest-priority newest request is the worst (so tenants
        level with each other give up what one tenant would)."""
        loads = {t: self.load(t) for t, n in self.sequences.items() if n > 0 and t != exclude}
        if not loads:
            return None
        top = max(loads.values())
        tied = [tenant for tenant, load in loads.items() if load == top]
        if len(tied) == 1:
            return tied[0]
        worst = {tenant: worst_of(running, tenant) for tenant in tied}
        return max(tied, key=lambda t: worst[t].scheduling_key)  # type: ignore[union-attr]


def preemption_victim(running: Sequence[Request], forks: Forks) -> Request:
    """The running request to preempt when KV runs out: the lowest-priority, newest request
    (highest `scheduling_key`) of the tenant most over its weighted share. With one tenant
    running, exactly the lowest-priority newest request, as before tenants."""
    if one_tenant(running):
        return max(running, key=SERVICE_ORDER)
    victim = worst_of(running, Shares(running, forks).most_loaded(running) or "")
    assert victim is not None, "a tenant with sequences runs a request"
    return victim


def admission_order(waiting: Iterable[Request], shares: Shares) -> Iterator[Request]:
    """Waiting requests in the order to admit them: next, the head (by priority, then arrival)
    of the waiting tenant with the least load, of equal loads the better head. Each request
    yielded is counted as admitted (with its forks) when the next is asked for: the scheduler
    stops at the first that cannot start, so a later request never overtakes it."""
    queues: dict[str, list[Request]] = {}
    for request in waiting:
        queues.setdefault(request.tenant, []).append(request)
    for queue in queues.values():
        queue.sort(key=SERVICE_ORDER, reverse=True)  # the head last: pop() takes it
    while queues:
        tenant = min(queues, key=lambda t: (shares.load(t), queues[t][-1].scheduling_key))
        queue = queues[tenant]
        head = queue.pop()
        if not queue:
            del queues[tenant]
        yield head
        shares.add(head)


def victim_for(waiting: Request, running: Sequence[Request], shares: Shares) -> Request | None:
    """A running request that `waiting` (which cannot start: the batch is full or KV is short)
    may take the place of, or None.

    Across tenants, only by share, and only when the waiting tenant, its new sequences
    counted, stays at or below the victim's tenant once the victim is out:
    (s_u + need) / w_u <= (s_v - freed) / w_v. Then s_u / w_u < s_v / w_v before the move,
    so the reverse move, which needs s_v / w_v < s_u / w_u, can never follow: two tenants
    cannot preempt each other back and forth, and at equal shares (s_v - s_u < 2 for equal
    weights) nobody moves. This is vLLM's "preempt for the waiting" of its priority policy
    with a bound instead of a cooldown: no count of steps to tune, and every move strictly
    evens the shares out.

    Within the waiting request's own tenant, by priority only (vLLM's priority policy): its
    lowest-priority newest running request, if strictly worse than `waiting`. The tenant's
    count is unchanged, and a strictly worse request never takes a better one's place, so
    this cannot cycle either, nor mix with the share rule.
    """
    tenant = waiting.tenant
    other = shares.most_loaded(running, exclude=tenant)
    if other is not None:
        after_u = shares.load(tenant) + num_sequences(waiting, shares.forks) / shares_weight(
            shares, waiting
        )
        w_v = shares.weights[other]
        # A victim frees at least one sequence: test that bound before looking for it.
        if after_u <= shares.load(other) - 1 / w_v:
            victim = worst_of(running, other)
            assert victim is not None, "a tenant with sequences runs a request"
            if after_u <= shares.load(other) - num_sequences(victim, shares.forks) / w_v:
                return victim
    if running and waiting.priority < max(map(_PRIORITY, running)):
        own = worst_of(running, tenant)
        if own is not None and waiting.priority < own.priority:
            return own
    return None


def shares_weight(shares: Shares, request: Request) -> float:
    """`request`'s tenant's weight: the counted one, or its own when none of it runs."""
    return shares.weights.get(request.tenant, request.weight)
