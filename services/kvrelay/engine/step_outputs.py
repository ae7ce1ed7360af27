"""A step's sampled tokens appended to their requests, with the stop checks, in one pass.

Every running request passes here every step, so the common case (no detokenizer, no
grammar, no logprobs, not a prefill engine) is a few attribute reads and a set lookup per
request: `Request.stop_watch` says when `check_stop` could answer at all. Anything else goes
through the engine's full per-token path. It never schedules, samples or builds outputs.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvrelay.engine.parent_request import ParentRequest
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.sampler import SampleLogprobs

# (request, token id, its logprobs entry) -> the request's parent, after the full path:
# the token appended, detokenized, checked against stops and the grammar, hand-off leased.
SlowPath = Callable[[Request, int, "dict[int, float] | None"], ParentRequest]
Finish = Callable[[Request, RequestStatus], None]
# (request ids, token ids): a step's rows of news that is one token (outputs.StepDelta).
Rows = tuple[list[str], list[int]]
_LAST_UNFINISHED = RequestStatus.PREEMPTED
_RUNNING = RequestStatus.RUNNING
_STATUS = operator.attrgetter("status")
_OUTPUTS = operator.attrgetter("output_token_ids")


def append_sampled(
    requests: Sequence[Request],
    token_ids: Sequence[int],
    logprobs: Sequence[SampleLogprobs | None],
    owner: Mapping[str, tuple[ParentRequest, int]],
    *,
    slow: SlowPath,
    finish: Finish,
    fast: bool = True,
    rows: Rows | None = None,
    steady: SteadyRows | None = None,
) -> tuple[dict[str, ParentRequest], int]:
    """Append each request's sampled token (skipping finished ones: failed this step, or a
    sibling failed), finishing those it stops.

    Args:
        owner: each sample's parent and index in it.
        slow: the full path, for a request with a detokenizer, a grammar or logprobs (and
            every request when `fast` is False: a prefill engine leases each one's KV).
        finish: the scheduler's `finish`, for a request the fast path stops.
        rows: (request ids, token ids) lists to append a fast-path token to instead of
            touching its parent, when the token did not finish it and the parent is
            `delta_ready` (outputs.StepDelta's rows); None: every parent is touched.
        steady: the caller's `SteadyRows`, tried first (with `fast` and `rows`).

    Returns:
        The parents touched, by request id in first-touch order, and the tokens the fast
        path appended (`slow` counts its own).
    """
    if (
        fast
        and rows is not None
        and steady is not None
        and steady.append(requests, token_ids, logprobs, owner, rows)
    ):
        return {}, len(requests)
    return _append_each(requests, token_ids, logprobs, owner, slow, finish, fast, rows)


def _append_each(
    requests: Sequence[Request],
    token_ids: Sequence[int],
    logprobs: Sequence[SampleLogprobs | None],
    owner: Mapping[str, tuple[ParentRequest, int]],
    slow: SlowPath,
    finish: Finish,
    fast: bool,
    rows: Rows | None,
) -> tuple[dict[str, ParentRequest], int]:
    """`append_sampled` request by request."""
    touched: dict[str, ParentRequest] = {}
    appended = 0
    for request, token_id, sample_logprobs in zip(requests, token_ids, logprobs, strict=True):
        if request.status > _LAST_UNFINISHED:
            continue
        parent, index = owner[request.request_id]
        if (
            fast
            and sample_logprobs is None
            and request.matcher is None
            and parent.detokenizers[index] is None
        ):
            appended += 1
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            outputs = request.output_token_ids
            outputs.append(token_id)
            stop_ids, limit = request.stop_watch
            if token_id in stop_ids or len(outputs) >= limit:
                status = request.check_stop()
                if status is not None:
                    finish(request, status)
                    touched[parent.request_id] = parent  # its final output: never a row
                    continue
            if rows is not None and parent.delta_ready:
                rows[0].append(parent.request_id)
                rows[1].append(token_id)
                continue
        else:
            entry = None if sample_logprobs is None else logprobs_entry(token_id, sample_logprobs)
            parent = slow(request, token_id, entry)
        touched[parent.request_id] = parent
    return touched, appended


def logprobs_entry(token_id: int, logprobs: SampleLogprobs) -> dict[int, float]:
    """A sampled token's logprobs entry: its top-k plus the token itself."""
    entry = dict(logprobs.top)
    entry[token_id] = logprobs.token_logprob
    return entry


class SteadyRows:
    """The last batch whose every request's token is a row (`append_sampled`'s fast way, its
    parent `delta_ready`), with what appending to it needs: while the next steps sample the
    same requests in the same order (a decode batch's usual case), their tokens go in with a
    few passes in C, no per-request checks. A step where any request has logprobs, is not
    running, or may stop (a token among any of them's stop ids, or an output length at any
    of them's limit) is left to the per-request way, which gives what this would have.
    """

    def __init__(self) -> None:
        self._batch: list[Request] = []
        self._parent_ids: list[str] = []
        self._stop_ids: frozenset[int] = frozenset()  # every request's, together
        self._limits = np.zeros(0, np.int64)
        self.steps = 0  # steps appended here (tests read it)

    def append(
        self,
        requests: Sequence[Request],
        token_ids: Sequence[int],
        logprobs: Sequence[SampleLogprobs | None],
        owner: Mapping[str, tuple[ParentRequest, int]],
        rows: Rows,
    ) -> bool:
        """Append `token_ids` to `requests` and to `rows` if the batch is steady and nothing
        in it can stop; False, having changed nothing, otherwise."""
        n = len(requests)
        if not n:  # an empty step (nothing scheduled) is no batch: `_batch` may be [] too
            return False
        if requests != self._batch and not self._remember(requests, owner):  # identity, in C
            return False
        if logprobs.count(None) != n or list(map(_STATUS, requests)).count(_RUNNING) != n:
            return False
        if not self._stop_ids.isdisjoint(token_ids):
            return False
        outputs_of = list(map(_OUTPUTS, requests))
        lengths = np.fromiter(map(len, outputs_of), np.int64, n)
        if bool((lengths + 1 >= self._limits).any()):
            return False
        for outputs, token_id in zip(outputs_of, token_ids, strict=True):
            outputs.append(token_id)
        rows[0].extend(self._parent_ids)
        rows[1].extend(token_ids)
        self.steps += 1
        return True

    def _remember(
        self, requests: Sequence[Request], owner: Mapping[str, tuple[ParentRequest, int]]
    ) -> bool:
        """Take `requests` as the batch if each one's token is a row once appended; stops at
        the first that is not (it may be next step: a request sampling its first token)."""
        self._batch = []
        parents = []
        for request in requests:
            if request.status is not _RUNNING:  # finished ones may have left `owner`
                return False
            parent, index = owner[request.request_id]
            if not (
                parent.delta_ready
                and request.matcher is None
                and request.first_token_time is not None
                and parent.detokenizers[index] is None
            ):
                return False
            parents.append(parent)
        watches = [request.stop_watch for request in requests]
        self._stop_ids = frozenset().union(*(stop_ids for stop_ids, _ in watches))
        self._limits = np.array([limit for _, limit in watches], np.int64)
        self._parent_ids = [parent.request_id for parent in parents]
        self._batch = list(requests)
        return True
