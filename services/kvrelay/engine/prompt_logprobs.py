"""vLLM's prompt_logprobs: the logprob, rank and top k of every prompt token given the tokens
before it, computed from the hidden states a prefill chunk already has.

Only the chunks of requests that ask pay for it: the runner otherwise computes logits for a
chunk's last row alone. A chunk covering prompt positions `start:end` scores the tokens
`start + 1 : end + 1` (position p's logits predict token p + 1), so chunked prefill needs no
state beyond how many tokens are scored so far (`Request.prompt_logprobs`), and a request
recomputed after preemption scores nothing twice. A prefix-cache hit has no hidden states:
the scheduler reuses cached blocks only up to the tokens already scored (`cacheable_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvrelay.common.messages import PromptLogprob
from kvrelay.engine.request import Request

if TYPE_CHECKING:  # the scheduler imports this module
    from kvrelay.engine.scheduled import ScheduledChunk

# Rows of logits made at once: [rows, vocab] fp32 (a 2k-token chunk of a 150k vocabulary at
# once would be 1.2 GB).
ROWS_PER_SLICE = 256


class PromptScores(NamedTuple):
    """The prompt tokens one chunk scored: entries for tokens `first`, `first + 1`, ..."""

    request: Request
    first: int  # the prompt position of entries[0]'s token (>= 1)
    entries: list[PromptLogprob]


class _Rows(NamedTuple):
    request: Request
    row: int  # the chunk's first row to score, in the step's flattened batch
    first: int  # the position of the first row scored (its token is first + 1)
    num_rows: int


def scored_rows(chunks: Sequence[ScheduledChunk]) -> list[_Rows]:
    """The rows of this step whose logits score prompt tokens not scored yet."""
    out: list[_Rows] = []
    row = 0
    for chunk in chunks:
        request = chunk.request
        if request.sampling_params.prompt_logprobs is not None:
            lo = max(chunk.start, len(request.prompt_logprobs))
            hi = min(chunk.end, request.num_prompt_tokens - 1)
            if lo < hi:
                out.append(_Rows(request, row + lo - chunk.start, lo, hi - lo))
        row += chunk.num_tokens
    return out


def score_prompts(
    rows: Sequence[_Rows],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[PromptScores]:
    """Each request's new prompt entries from the step's hidden states [T, H]."""
    out = []
    for request, row, first, count in rows:
        k = request.sampling_params.prompt_logprobs or 0
        targets = request.prompt_token_ids[first + 1 : first + 1 + count]
        entries: list[PromptLogprob] = []
        for offset in range(0, count, ROWS_PER_SLICE):
            size = min(ROWS_PER_SLICE, count - offset)
            logits = compute_logits(hidden[row + offset : row + offset + size])
            entries.extend(_entries(logits, targets[offset : offset + size], k))
        out.append(PromptScores(request, first + 1, entries))
    return out


def _entries(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[PromptLogprob]:
    # logits: [R, V] -> logprobs from the raw logits (as the sampled tokens' are)
    lp = logits.float().log_softmax(dim=-1)  # [R, V]
    index = torch.tensor(targets, dtype=torch.int64).to(lp.device, non_blocking=True)
    chosen = lp.gather(1, index[:, None])  # [R, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [R]; ties share the better rank, as vLLM's
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [R, k]
    # One copy back each, not one per row.
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    values, ids = top_v.tolist(), top_i.tolist()
    return [
        PromptLogprob(token, chosen_l[j], ranks_l[j], list(zip(ids[j], values[j], strict=True)))
        for j, token in enumerate(targets)
    ]


def take_scores(scores: Sequence[PromptScores]) -> None:
    """Append each request's new entries (positions line up: `first` is the next token)."""
    for request, first, entries in scores:
        have = len(request.prompt_logprobs) + 1  # the next token to score
        if first <= have:
            request.prompt_logprobs.extend(entries[have - first :])


def cacheable_blocks(request: Request, cached: list[int], block_size: int) -> list[int]:
    """The prefix-cache hit a request may use: all of it, unless it still needs prompt
    logprobs, whose positions must be computed (a cached block has no hidden states)."""
    if request.sampling_params.prompt_logprobs is None:
        return cached
    scored = len(request.prompt_logprobs)
    if scored >= request.num_prompt_tokens - 1:
        return cached
    return cached[: scored // block_size]
