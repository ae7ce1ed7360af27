"""Which running requests take a plain decode this step, found for the whole batch at once.

Every running request passes the scheduler every step, and most are plain decodes: one token
left to compute, which samples, lands in the last block of the request's table and that block
is the request's alone (no allocation, no copy-on-write). Checked one request at a time
(attribute reads, a `decode_fits` call, the chunk built) that cost ~2.5 us a request on a
2-core CI host, 0.9 ms of a 256-decode step's host time (benchmarks/host_overhead.py
--phases). Here the same checks run over the batch's columns, read in C (`map` over attribute
getters) and compared in numpy.

A True is the per-request path's own verdict; a False is no verdict: the scheduler's
per-request path decides those rows (a copy-on-write, a prefill chunk, a token in flight that
ends the request...), as it does every row when this returns None. A decode whose token opens
a new block (one row in 16 per step, with 16-token blocks) is marked apart: the scheduler
gives those their blocks in one allocation when the pool has room for every row that may
allocate, which is what the per-request path would do row by row (~10 us each).
"""

from __future__ import annotations

from operator import attrgetter, itemgetter

import numpy as np
import numpy.typing as npt

from kvrelay.engine.kv_cache.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request, RequestStatus

_STATUS = attrgetter("status")
_COMPUTED = attrgetter("num_computed_tokens")
_PENDING = attrgetter("num_pending")
_PROMPT = attrgetter("prompt_token_ids")
_OUTPUTS = attrgetter("output_token_ids")
_STOP_WATCH = attrgetter("stop_watch")  # (stop ids, output tokens it may reach)
_LIMIT = itemgetter(1)
_ID = attrgetter("request_id")

# The fewest running requests the whole-batch reads pay for: each column costs a fixed few
# microseconds of numpy. Measured on the scheduler's step alone (schedule, update, append;
# 2-core AMD EPYC, AVX2, 2026-12-06): 0.85x the per-request path's time at 256 requests,
# 0.88x at 128, 0.96x at 64, 1.45x at 16, 6x at 1 (64 us against 12).
MIN_ROWS = 64

# Each running request's num_computed_tokens (its decode's start), the rows to take as plain
# decodes, and of those the rows whose token opens a new block (ascending).
PlainDecodes = tuple[list[int], npt.NDArray[np.bool_], list[int]]


class PlainDecodeFinder:
    """`find` the plain decodes of the running batch. What never changes in a request (its
    id, its prompt's length, its output limit) is read once per service order: the
    scheduler hands the same list while the running batch does not change."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self._order: list[Request] | None = None
        self._ids: list[str] = []
        self._prompt_lens = np.zeros(0, np.int64)
        self._limits = np.zeros(0, np.int64)

    def find(self, running: list[Request]) -> PlainDecodes | None:
        """The requests of `running` (all RUNNING) whose step is a plain decode: tokens
        known (prompt, outputs and the one in flight) one more than those computed, no token
        in flight that reaches its output limit (the scheduler skips those), the next
        token's slot in a block it owns alone (`KVCacheManager.decodes_fit`) or, when the
        pool has room (`_openings`), in a new block after a table of full blocks.

        Returns:
            The starts (num_computed_tokens) in `running`'s order, which rows are plain,
            and the plain rows whose token opens a new block (the scheduler appends their
            blocks in order); None under MIN_ROWS requests, or when some request is not
            RUNNING or holds no blocks (the per-request path decides every row then).
        """
        n = len(running)
        if n < MIN_ROWS or list(map(_STATUS, running)).count(RequestStatus.RUNNING) != n:
            return None
        if running is not self._order:
            self._read_constants(running)
        starts = list(map(_COMPUTED, running))
        computed = np.array(starts, np.int64)
        outputs = np.fromiter(map(len, map(_OUTPUTS, running)), np.int64, n)
        pending = np.fromiter(map(_PENDING, running), np.int64, n)
        known = self._prompt_lens + outputs + pending
        ends_in_flight = (pending > 0) & (outputs + 1 >= self._limits)
        slots = self.kv_cache.decodes_fit(self._ids, computed)
        if slots is None:
            return None
        decodes = (known - computed == 1) & ~ends_in_flight
        fits, opens = slots
        plain, opens = decodes & fits, decodes & opens
        openings = self._openings(plain, opens)
        return starts, (plain | opens) if openings else plain, openings

    def _openings(self, plain: npt.NDArray[np.bool_], opens: npt.NDArray[np.bool_]) -> list[int]:
        """The rows whose decode opens a new block, to take as plain decodes: all of them
        when the pool has a block for each, and two for every other row that is not plain
        (the most one decode allocates: a copy and a new block), so that no row of the
        decode pass can preempt; none otherwise (each goes the per-request way)."""
        num_opens = int(np.count_nonzero(opens))
        if not num_opens:
            return []
        others = len(opens) - num_opens - int(np.count_nonzero(plain))
        if self.kv_cache.num_free_blocks < num_opens + 2 * others:
            return []
        return np.flatnonzero(opens).tolist()

    def _read_constants(self, running: list[Request]) -> None:
        n = len(running)
        self._order = running
        self._ids = list(map(_ID, running))
        self._prompt_lens = np.fromiter(map(len, map(_PROMPT, running)), np.int64, n)
        self._limits = np.fromiter(map(_LIMIT, map(_STOP_WATCH, running)), np.int64, n)
