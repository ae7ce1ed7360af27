"""Contains a sampling failure to the rows that caused it, so one request never fails a batch.

Validation can never be complete: when a step's batched sampling raises, each row is sampled
alone with the uniform it already drew, so innocent rows get exactly the tokens the batched
call would have given them (the sampler is batch-invariant) and no generator advances twice.
It only samples; failing the culprit requests is the engine's part.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvrelay.engine.request import Request
from kvrelay.engine.sampler import SampleLogprobs, Sampler, SamplingRow

logger = logging.getLogger(__name__)

# What the client of a request failed here is told (RequestOutput.error): nothing internal.
SAMPLING_FAILED = (
    "the server could not sample a token for this request "
    "(its sampling parameters could not be applied)"
)


class IsolatedSample(NamedTuple):
    """A step's samples: one token and logprobs entry per row, and the rows that could not
    be sampled (their token is -1, their logprobs None)."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]
    failed: list[int]


def sample_isolating(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    requests: Sequence[Request],
    uniforms: torch.Tensor | None = None,
) -> IsolatedSample:
    """Sample every row of `logits` [S, V], keeping apart the rows that cannot be sampled.

    The batch is sampled at once; only when that raises is each row re-run alone (cost: S
    single-row samples, once per failing step). A row that fails alone is a culprit, logged
    with its traceback under its request's id. If no row fails alone the batched
    failure was not any request's doing: every row keeps its single-row sample. The batched
    path returns the sampler's own lists: nothing is built per row. `uniforms`: the step's
    draws when already drawn (a deferred sampling that raised: runner.py), else drawn here.
    """
    if uniforms is None:
        uniforms = sampler.draw_uniforms(rows)  # [S]: every draw of this step, before any risk
    try:
        out = sampler.sample(logits, rows, uniforms)
    except Exception:
        logger.warning(
            "batched sampling of %d rows failed; sampling each row alone to find the culprit",
            len(rows),
            exc_info=True,
        )
        return _sample_each_alone(sampler, logits, rows, uniforms, requests)
    return IsolatedSample(out.token_ids, out.logprobs, [])


def _sample_each_alone(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    uniforms: torch.Tensor,
    requests: Sequence[Request],
) -> IsolatedSample:
    result = IsolatedSample([], [], [])
    for i, request in enumerate(requests):
        try:
            out = sampler.sample(logits[i : i + 1], rows[i : i + 1], uniforms[i : i + 1])
        except Exception:
            name = request.request_id
            logger.exception("request %s: sampling failed; failing this request alone", name)
            result.token_ids.append(-1)
            result.logprobs.append(None)
            result.failed.append(i)
            continue
        result.token_ids.append(out.token_ids[0])
        result.logprobs.append(out.logprobs[0])
    return result
