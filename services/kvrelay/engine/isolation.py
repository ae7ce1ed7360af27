"""Contains a sampling failure to the rows that caused it, so one request never fails a batch.

Validation can never be complete: when a step's batched sampling raises, each row is sampled
alone with the uniform it already drew, so innocent rows get exactly the tokens the batched
call would have given them (the sampler is batch-invariant) and no generator advances twice.
It only samples; failing the culprit requests is the engine's part.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.engine.sampler import SampleLogprobs, Sampler, SamplingRow

logger = logging.getLogger(__name__)

# What the client of a request failed here is told (RequestOutput.error): nothing internal.
SAMPLING_FAILED = (
    "the server could not sample a token for this request "
    "(its sampling parameters could not be applied)"
)


@dataclass(frozen=True)
class RowSample:
    """One row's sampled token."""

    token_id: int
    logprobs: SampleLogprobs | None


def sample_isolating(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow], names: Sequence[str]
) -> list[RowSample | None]:
    """Sample every row of `logits` [S, V]; None for each row that cannot be sampled.

    The batch is sampled at once; only when that raises is each row re-run alone (cost: S
    single-row samples, once per failing step). A row that fails alone is a culprit, logged
    with its traceback under `names[i]` (its request id). If no row fails alone the batched
    failure was not any request's doing: every row keeps its single-row sample.
    """
    uniforms = sampler.draw_uniforms(rows)  # [S]: every draw of this step, before any risk
    try:
        out = sampler.sample(logits, rows, uniforms)
    except Exception:
        logger.warning(
            "batched sampling of %d rows failed; sampling each row alone to find the culprit",
            len(rows),
            exc_info=True,
        )
        return [
            _sample_alone(sampler, logits, rows, uniforms, i, names[i]) for i in range(len(rows))
        ]
    return [RowSample(t, lp) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]


def _sample_alone(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    uniforms: torch.Tensor,
    i: int,
    name: str,
) -> RowSample | None:
    try:
        out = sampler.sample(logits[i : i + 1], rows[i : i + 1], uniforms[i : i + 1])
    except Exception:
        logger.exception("request %s: sampling failed; failing this request alone", name)
        return None
    return RowSample(out.token_ids[0], out.logprobs[0])
