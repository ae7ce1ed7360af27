"""Continuous batching: which requests run this step, and how many of their tokens.

One token budget per step covers decode tokens and prefill chunks alike. Running requests are
served first (decodes before prefill chunks), then waiting ones are admitted in priority /
arrival order. When the KV pool runs out, the newest, lowest-priority running request is
preempted: its blocks are freed and it is recomputed later (its output is kept).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvrelay.config import SchedulerConfig
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `start:start + num_tokens` of `request` (prompt + output), to compute this step."""

    request: Request
    start: int
    num_tokens: int
    # True when the chunk reaches the request's last token, so a new token is sampled.
    samples: bool

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Holds the waiting and running requests and builds each step's batch."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Updates `running` / `waiting`, allocates KV slots."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark `request` finished, take it out of the queues and free its blocks."""
        assert status.is_finished
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)

    def _chunk_size(self, request: Request, budget: int) -> int:
        size = min(request.num_tokens - request.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(size, threshold) if threshold else size

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first: a long prompt's next chunk must never delay the tokens of running
        # streams. Within each kind, older / higher-priority requests come first.
        ordered = sorted(
            self.running,
            key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.scheduling_key()),
        )
        for request in ordered:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            size = self._chunk_size(request, budget)
            if size == 0:
                continue
            if not self._allocate_or_preempt(request, request.num_computed_tokens + size, out):
                continue
            out.chunks.append(ScheduledChunk.of(request, size))
            budget -= size
        return budget

    def _allocate_or_preempt(self, request: Request, total: int, out: SchedulerOutput) -> bool:
        """Find KV room for `request`, preempting lower-priority running requests if needed.

        Returns False when `request` itself was preempted.
        """
        while not self.kv_cache.allocate_slots(request.request_id, total):
            victim = max(self.running, key=lambda r: r.scheduling_key())
            scheduled = [c for c in out.chunks if c.request is victim]
            if scheduled:
                # A victim already in this step's batch gives its tokens back to the budget
                # only implicitly: the step simply runs fewer tokens.
                out.chunks.remove(scheduled[0])
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for request in sorted(self.waiting, key=lambda r: r.scheduling_key()):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            size = self._chunk_size(request, budget)
            if not self.kv_cache.allocate_slots(
                request.request_id, request.num_computed_tokens + size
            ):
                # Strict order: a later request never overtakes one that does not fit yet.
                return
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk.of(request, size))
            budget -= size

    def update_after_step(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Record that the chunks' tokens are now in the KV cache."""
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
