"""Routing as a pipeline: filters -> scorers in [0, 1], weighted -> pick.

Filters drop workers that cannot take the request (wrong role, no KV room); scorers rate the
rest: prefix-cache overlap (fewer tokens to prefill), queue depth and KV usage (less waiting,
less preemption). The best weighted sum wins; ties go round-robin so equal workers share load.
`round_robin` ignores the scores, as a plain policy and as the baseline to measure against.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.router.prefix_index import PrefixIndex
from kvrelay.router.workers import WorkerState


@dataclass(frozen=True)
class RouteQuery:
    """What routing knows of a request."""

    prompt_hashes: Sequence[bytes]  # chain hashes of the prompt's full blocks
    blocks_needed: int  # KV blocks the whole request may need


Filter = Callable[[WorkerState, RouteQuery], bool]
Scorer = Callable[[WorkerState, RouteQuery, PrefixIndex], float]


def has_kv_room(worker: WorkerState, query: RouteQuery) -> bool:
    """Room for the request's blocks, or an idle worker (it would preempt nobody)."""
    return worker.free_blocks >= query.blocks_needed or worker.queue_depth == 0


def prefix_score(worker: WorkerState, query: RouteQuery, index: PrefixIndex) -> float:
    if not query.prompt_hashes:
        return 0.0
    return index.matched_blocks(worker.worker_id, query.prompt_hashes) / len(query.prompt_hashes)


def queue_score(worker: WorkerState, query: RouteQuery, index: PrefixIndex) -> float:
    return 1.0 / (1.0 + worker.queue_depth)


def kv_usage_score(worker: WorkerState, query: RouteQuery, index: PrefixIndex) -> float:
    return 1.0 - min(1.0, worker.kv_usage)


SCORERS: dict[str, Scorer] = {
    "prefix": prefix_score,
    "queue": queue_score,
    "kv_usage": kv_usage_score,
}
DEFAULT_WEIGHTS = {"prefix": 2.0, "queue": 1.0, "kv_usage": 1.0}


@dataclass
class RoutingPolicy:
    """`policy` is "score" (the weighted pipeline) or "round_robin"."""

    policy: str = "score"
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    filters: list[Filter] = field(default_factory=lambda: [has_kv_room])
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in ("score", "round_robin"):
            raise ValueError(f"routing policy must be score or round_robin, not {self.policy!r}")
        unknown = set(self.weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorers {sorted(unknown)}; known: {sorted(SCORERS)}")

    def pick(
        self, workers: Sequence[WorkerState], query: RouteQuery, index: PrefixIndex
    ) -> WorkerState | None:
        """The worker to send the request to; None when none can take it."""
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.worker_id)  # a stable round-robin order
        turn = next(self._turn)
        if self.policy == "round_robin":
            return ordered[turn % len(ordered)]
        fit = [w for w in ordered if all(f(w, query) for f in self.filters)] or ordered
        scores = [self.score(w, query, index) for w in fit]
        best = max(scores)
        tied = [w for w, s in zip(fit, scores, strict=True) if s >= best - 1e-9]
        return tied[turn % len(tied)]

    def score(self, worker: WorkerState, query: RouteQuery, index: PrefixIndex) -> float:
        return sum(
            weight * SCORERS[name](worker, query, index) for name, weight in self.weights.items()
        )
