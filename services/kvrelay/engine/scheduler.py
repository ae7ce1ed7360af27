"""Continuous batching: which requests run this step, and how many of their tokens.

One token budget per step covers decode tokens and prefill chunks alike. Running requests are
served first (decodes before prefill chunks), then waiting ones are admitted: with one tenant
waiting, in priority / arrival order; with several, the least-served tenant's first (running
sequences / weight, engine/fair_share.py). When the KV pool runs out, the newest,
lowest-priority running request of the tenant most over its share is preempted: its blocks are
freed and it is recomputed later (its output is kept), reusing whatever of it the prefix cache
still holds. A waiting request that cannot start (batch or KV full) takes the place of a
running request of a tenant well over its share, or of a worse-priority one of its own tenant
(`fair_share.victim_for`: bounded so that nobody is preempted back and forth).

A request admitted with `forks` (the other samples of an `n` > 1 request) prefills once; its
forks join at its first sampled token, sharing its blocks (copy-on-write), and count as
sequences of its tenant. A request whose prompt KV is being pulled from a prefill engine waits
apart (`add_waiting_for_remote_kv`) until `finish_remote_kv` lets it run or recompute.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np

from kvrelay.config import SchedulerConfig
from kvrelay.engine import fair_share
from kvrelay.engine.block_fence import BlockFence
from kvrelay.engine.fair_share import SERVICE_ORDER as _SERVICE_ORDER
from kvrelay.engine.fair_share import Shares
from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.plain_decodes import PlainDecodeFinder, PlainDecodes
from kvrelay.engine.prompt_logprobs import cacheable_blocks
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduled import NEW_CHUNK, REQUEST_OF, ScheduledChunk, SchedulerOutput

# A decode chunk's (num_tokens, samples, forks): one token that samples, joined by no fork.
_DECODE = (1, True, ())
# Every status after it is a finished one. A module constant: reading an enum member off its
# class costs ~0.2 us, a fifth of `update_after_step`'s time per row.
_LAST_UNFINISHED = RequestStatus.PREEMPTED


class Scheduler:
    """Holds the waiting and running requests and builds each step's batch."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Requests whose prompt KV is being pulled from a prefill engine (blocks allocated),
        # by request id: neither waiting nor running until `finish_remote_kv`.
        self.waiting_for_remote_kv: dict[str, Request] = {}
        self.num_preemptions = 0
        # Samples waiting for their leader's first token, by leader request id.
        self._forks: dict[str, list[Request]] = {}
        # `running` as of the last step, and in service order (`_in_service_order`).
        self._last_running: list[Request] = []
        self._last_order: list[Request] = []
        # Chunks of the current step that decode (one sampling token, no forks): a step of
        # only those is a pure decode step (SchedulerOutput.decodes_only).
        self._num_decodes = 0
        # `waiting`, `running` and the pending forks' count when the batch was full and no
        # waiting request could take anyone's place: while none of them changes, neither does
        # that answer (it reads no KV), so a full batch nothing leaves costs one comparison
        # per step instead of counting every running request's tenant again.
        self._stuck: tuple[list[Request], list[Request], int] | None = None
        self._plain_decodes = PlainDecodeFinder(kv_cache)
        # Async scheduling: requests with a sampled token not yet read count it as known
        # (Request.num_pending), and blocks a launched step uses are freed through this.
        self.fence: BlockFence | None = None

    @property
    def num_unfinished(self) -> int:
        pending = sum(len(forks) for forks in self._forks.values())
        remote = len(self.waiting_for_remote_kv)
        return len(self.waiting) + len(self.running) + pending + remote

    @property
    def forking(self) -> bool:
        """Whether some request's samples wait to fork at its first token."""
        return bool(self._forks)

    def add(self, request: Request, forks: Sequence[Request] = ()) -> None:
        """Queue `request`; `forks` (same prompt and params) will share its prefill."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if forks:
            for fork in forks:
                fork.status = RequestStatus.WAITING
            self._forks[request.request_id] = list(forks)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Updates `running` / `waiting`, allocates KV slots."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.copies = self.kv_cache.take_copies()
        if out.preempted:  # victims' chunks were taken out: count again
            self._num_decodes = sum(chunk[2:] == _DECODE for chunk in out.chunks)
        out.decodes_only = 0 < len(out.chunks) == self._num_decodes
        return out

    def detach(self, request: Request) -> None:
        """Take a running request out of the batch, keeping its blocks (prefill hand-off)."""
        self.running.remove(request)

    def add_waiting_for_remote_kv(self, request: Request) -> None:
        """Hold `request`, whose prompt blocks are allocated, while its KV is pulled from a
        prefill engine. It is not scheduled until `finish_remote_kv`."""
        assert request.request_id not in self.waiting_for_remote_kv
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kv[request.request_id] = request

    def finish_remote_kv(self, request: Request, ok: bool) -> None:
        """The pull for `request` is over. `ok`: its prompt's K/V are in its blocks (full
        blocks prefix-cached), so it joins the running batch, or, when the batch holds
        `max_num_seqs` already, waits for a seat keeping its blocks (admitted like any waiting
        request, by tenant share: a prefill engine's requests obey the seat limit too).
        Otherwise its blocks are freed and it waits to recompute its prompt here."""
        del self.waiting_for_remote_kv[request.request_id]
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv_cache.cache_full_blocks(request)
            if len(self.running) < self.config.max_num_seqs:
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            else:
                request.status = RequestStatus.WAITING
                self.waiting.append(request)
        else:
            self.kv_cache.free(request.request_id)
            request.num_computed_tokens = 0
            self.add(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark `request` finished, take it out of the queues and free its blocks."""
        assert status.is_finished
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.waiting_for_remote_kv.get(request.request_id) is request:
            del self.waiting_for_remote_kv[request.request_id]
        else:
            for forks in self._forks.values():
                if request in forks:
                    forks.remove(request)
        fence = self.fence
        if fence is not None and fence.in_use(request):
            # Its blocks go back once the launched step that uses them is done.
            fence.hold(request, self.kv_cache.release(request.request_id))
        else:
            self.kv_cache.free(request.request_id)
        orphans = self._forks.pop(request.request_id, [])
        if orphans:
            # The leader ended before its prefill: the next sample leads the rest.
            self.add(orphans[0], orphans[1:])

    def _chunk_size(self, request: Request, budget: int) -> int:
        size = min(request.num_tokens + request.num_pending - request.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(size, threshold) if threshold else size

    def _in_service_order(self) -> list[Request]:
        """`running` sorted by `Request.scheduling_key`; the last step's order when `running`
        holds the same requests in the same order (a decode step's usual case: the list
        comparison is by identity, in C)."""
        if self.running != self._last_running:
            self._last_running = self.running[:]
            self._last_order = sorted(self.running, key=_SERVICE_ORDER)
        return self._last_order

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first: a long prompt's next chunk must never delay the tokens of running
        # streams. Within each kind, older / higher-priority requests come first. One pass
        # in service order serves the decodes and sets the prefills aside for a second.
        # Every running request passes here every step: the plain decodes of the batch are
        # found at once (plain_decodes.py), the rest one by one.
        order = self._in_service_order()
        prefills: list[Request] = []
        self._num_decodes = 0
        plain = None
        if len(order) <= budget and not self._forks:  # every decode fits the budget
            plain = self._plain_decodes.find(order)
        rest = order
        if plain is not None:
            budget, rest = self._take_plain_decodes(order, plain, out, budget, prefills)
        for request in rest:
            if budget == 0:
                return budget
            budget = self._schedule_running_one(request, out, budget, prefills)
        for request in prefills:
            if budget == 0:
                break
            budget = self._schedule_one(request, out, budget)
        return budget

    def _take_plain_decodes(
        self,
        order: list[Request],
        plain: PlainDecodes,
        out: SchedulerOutput,
        budget: int,
        prefills: list[Request],
    ) -> tuple[int, list[Request]]:
        """The decode pass over `order` with its plain decodes' chunks built at once (in C)
        and the other rows taken one by one, in order. After a preemption the rows left may
        have lost their place or their blocks: they are handed back, to go one by one.

        Returns:
            The budget left and the rows still to schedule."""
        starts, is_plain, opening = plain
        chunks = out.chunks
        built = list(map(NEW_CHUNK, zip(order, starts, repeat(1), repeat(True), repeat(()))))
        begin = 0
        for index in [*np.flatnonzero(~is_plain).tolist(), len(order)]:
            if opening and opening[0] < index:  # their blocks, in order, before the next row's
                taken = bisect_left(opening, index)
                self.kv_cache.append_blocks([order[row].request_id for row in opening[:taken]])
                del opening[:taken]
            chunks += built[begin:index]
            self._num_decodes += index - begin
            budget -= index - begin
            if index == len(order):
                break
            budget = self._schedule_running_one(order[index], out, budget, prefills)
            begin = index + 1
            if out.preempted:
                return budget, order[begin:]
        return budget, []

    def _schedule_running_one(
        self, request: Request, out: SchedulerOutput, budget: int, prefills: list[Request]
    ) -> int:
        """The decode pass for one running request: its decode, or set aside with the
        prefills (`prefills`). Returns the budget left."""
        chunks = out.chunks
        start = request.num_computed_tokens
        outputs = request.output_token_ids
        left = len(request.prompt_token_ids) + len(outputs) + request.num_pending - start
        if request.num_pending and len(outputs) + 1 >= request.stop_watch[1]:
            return budget  # its token not yet read ends it (max_tokens or length): no more
        if left > 1:
            prefills.append(request)
        elif (
            left == 1
            and request.status is RequestStatus.RUNNING
            and not (self._forks and request.request_id in self._forks)
            and self.kv_cache.decode_fits(request.request_id, start)
        ):  # the token lands in a block it owns alone: nothing to allocate
            chunks.append(ScheduledChunk(request, start, 1, True))
            self._num_decodes += 1
            budget -= 1
        else:  # a new block, a copy-on-write, forks, or a prefill chunk of one token
            scheduled = len(chunks)
            budget = self._schedule_one(request, out, budget)
            if len(chunks) > scheduled and chunks[-1][2:] == _DECODE:
                self._num_decodes += 1
        return budget

    def _schedule_one(self, request: Request, out: SchedulerOutput, budget: int) -> int:
        """Schedule running `request`'s next chunk within `budget`; the budget left."""
        if request.status != RequestStatus.RUNNING:
            return budget  # preempted earlier in this step to make room
        start = request.num_computed_tokens
        left = request.num_tokens + request.num_pending - start
        size = 1 if left == 1 else self._chunk_size(request, budget)
        if size == 0 or not self._allocate_or_preempt(request, start + size, out):
            return budget
        out.chunks.append(self._chunk(request, size))
        return budget - size

    def _allocate_or_preempt(self, request: Request, total: int, out: SchedulerOutput) -> bool:
        """Find KV room for `request`, preempting running requests if needed (the newest,
        lowest-priority of the tenant most over its share: `fair_share.preemption_victim`).

        Returns False when `request` itself was preempted.
        """
        while not self.kv_cache.allocate_slots(
            request.request_id, total, num_computed_tokens=request.num_computed_tokens
        ):
            victim = fair_share.preemption_victim(self.running, self._forks)
            self._evict(victim, out)
            if victim is request:
                return False
        return True

    def _evict(self, victim: Request, out: SchedulerOutput) -> None:
        """Preempt running `victim` within this step, taking its chunk out if scheduled."""
        scheduled = [c for c in out.chunks if c.request is victim]
        if scheduled:
            # A victim already in this step's batch gives its tokens back to the budget only
            # implicitly: the step simply runs fewer tokens.
            out.chunks.remove(scheduled[0])
        self._preempt(victim)
        out.preempted.append(victim)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.fence is not None and self.fence.in_use(request):
            # Its blocks are needed now (that is why it is preempted): wait for the launched
            # step that uses them instead of holding them (rare: a full KV pool).
            self.fence.wait()
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting or self._stuck == (self.waiting, self.running, self._num_forks()):
            return
        self._stuck = None
        shares: Shares | None = None  # counted only when several tenants wait or one is stuck
        order: Iterable[Request]
        if fair_share.one_tenant(self.waiting):
            order = sorted(self.waiting, key=_SERVICE_ORDER)
        else:
            shares = Shares(self.running, self._forks)
            order = fair_share.admission_order(self.waiting, shares)
        for request in order:
            if budget == 0:
                return
            full = len(self.running) >= self.config.max_num_seqs
            size = None if full else self._allocate_waiting(request, budget)
            if size is None:
                # Counted afresh for one tenant: earlier admissions of this loop count too.
                stuck = shares if shares is not None else Shares(self.running, self._forks)
                size = self._make_room(request, budget, stuck, out)
                if size is None:
                    # Strict order: a later request never overtakes one that cannot start.
                    if len(self.running) >= self.config.max_num_seqs:
                        self._stuck = (self.waiting[:], self.running[:], self._num_forks())
                    return
            self._start(request, size, out)
            budget -= size

    def _num_forks(self) -> int:
        return sum(map(len, self._forks.values())) if self._forks else 0

    def _allocate_waiting(self, request: Request, budget: int) -> int | None:
        """Allocate waiting `request`'s first chunk (prefix-cache hits reused); its size, or
        None when the KV pool has no room for it."""
        if request.num_computed_tokens:  # landed from a prefill engine: holds its prompt's KV
            return self._allocate_landed(request, budget)
        cached = self.kv_cache.find_cached_prefix(request)
        if request.sampling_params.prompt_logprobs is not None:
            cached = cacheable_blocks(request, cached, self.kv_cache.block_size)
        num_cached = len(cached) * self.kv_cache.block_size
        request.num_computed_tokens = num_cached
        size = self._chunk_size(request, budget)
        if not self.kv_cache.allocate_slots(
            request.request_id, num_cached + size, cached_blocks=cached
        ):
            request.num_computed_tokens = 0
            return None
        if self.kv_cache.enable_caching:
            self.kv_cache.stats.queries += request.num_tokens
            self.kv_cache.stats.hits += num_cached
        request.num_cached_tokens = num_cached
        return size

    def _allocate_landed(self, request: Request, budget: int) -> int | None:
        """Allocate the next chunk (its first decode) of a request waiting with its prompt's
        KV in place; its size, or None when the KV pool has no room for it."""
        start = request.num_computed_tokens
        size = self._chunk_size(request, budget)
        if not self.kv_cache.allocate_slots(
            request.request_id, start + size, num_computed_tokens=start
        ):
            return None
        return size

    def _make_room(
        self, request: Request, budget: int, shares: Shares, out: SchedulerOutput
    ) -> int | None:
        """Preempt running requests that waiting `request` may take the place of
        (`fair_share.victim_for`) until it can start; its first chunk's size, or None when
        no (further) victim may be taken. Victims taken before a None stay preempted: the
        rule only ever moves sequences towards the tenants under their share."""
        while (victim := fair_share.victim_for(request, self.running, shares)) is not None:
            shares.remove(victim)
            self._evict(victim, out)
            if len(self.running) < self.config.max_num_seqs:
                size = self._allocate_waiting(request, budget)
                if size is not None:
                    return size
        return None

    def _start(self, request: Request, size: int, out: SchedulerOutput) -> None:
        """Move waiting `request`, its first chunk allocated, into the running batch."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.chunks.append(self._chunk(request, size))

    def _chunk(self, request: Request, size: int) -> ScheduledChunk:
        forks = self._forks.get(request.request_id) if self._forks else None
        return ScheduledChunk.of(request, size, tuple(forks) if forks else ())

    def update_after_step(
        self, chunks: Iterable[ScheduledChunk], decodes_only: bool = False
    ) -> None:
        """Record that the chunks' tokens are now in the KV cache, cache the blocks they
        filled, and let the forks of a leader that just sampled join `running`. `decodes_only`:
        a pure decode step's chunks (`SchedulerOutput.decodes_only`), counted 4x faster."""
        if decodes_only:
            return self._update_decodes(chunks)
        block_size = self.kv_cache.block_size
        for request, _, num_tokens, _, forks in chunks:
            if request.status > _LAST_UNFINISHED:
                continue  # async scheduling: it finished after this step was launched
            before = request.num_computed_tokens
            request.num_computed_tokens = after = before + num_tokens
            # Blocks fill only where a chunk crosses a block boundary (after each step the
            # cache holds every full block: nothing to catch up on in between).
            if after // block_size != before // block_size:
                self.kv_cache.cache_full_blocks(request)
            if forks:
                self._join_forks(request, forks)

    def _update_decodes(self, chunks: Iterable[ScheduledChunk]) -> None:
        block_size = self.kv_cache.block_size
        for request in map(REQUEST_OF, chunks):
            if request.status > _LAST_UNFINISHED:
                continue
            request.num_computed_tokens = computed = request.num_computed_tokens + 1
            if not computed % block_size:  # its token filled a block
                self.kv_cache.cache_full_blocks(request)

    def _join_forks(self, request: Request, forks: tuple[Request, ...]) -> None:
        """`request`, the leader, sampled its first token: its forks share its blocks and run."""
        del self._forks[request.request_id]
        for fork in forks:
            self.kv_cache.fork(request.request_id, fork.request_id)
            fork.num_computed_tokens = request.num_computed_tokens
            fork.num_cached_tokens = request.num_cached_tokens
            fork.status = RequestStatus.RUNNING
            # May exceed max_num_seqs by n - 1: the leader was admitted for all n.
            self.running.append(fork)
