"""A step's sampled tokens appended to their requests, with the stop checks, in one pass.

Every running request passes here every step, so the common case (no detokenizer, no
grammar, no logprobs, not a prefill engine) is a few attribute reads and a set lookup per
request: `Request.stop_watch` says when `check_stop` could answer at all. Anything else goes
through the engine's full per-token path. It never schedules, samples or builds outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

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

    Returns:
        The parents touched, by request id in first-touch order, and the tokens the fast
        path appended (`slow` counts its own).
    """
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
