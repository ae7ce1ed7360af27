"""Logit penalties, logit biases and the min_tokens mask, batched as sparse (row, token) updates.

Every function edits `logits` [S, V] in place and touches only the listed (row, token) pairs, so
its cost grows with the number of tokens seen, not with S x V. Nothing here samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def flatten_token_ids(
    seqs: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs of every token of seqs[i], attributed to batch row rows[i].

    Returns two int64 tensors [T] on `device`. Ids outside [0, vocab_size) are dropped: such a
    token can never be sampled, so masking or penalising it is a no-op.
    """
    # numpy converts lists ~7x faster than torch.tensor, and array('q') without a Python loop.
    parts = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    if not parts:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    lengths = np.fromiter((p.size for p in parts), dtype=np.int64, count=len(parts))
    toks = np.concatenate(parts)  # [T]
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), lengths)  # [T]
    keep = (toks >= 0) & (toks < vocab_size)
    if not keep.all():
        toks, row_ids = toks[keep], row_ids[keep]
    # Uploaded without waiting (pageable memory: the copy is staged, not a stream sync).
    return (
        torch.from_numpy(row_ids).to(device, non_blocking=True),
        torch.from_numpy(toks).to(device, non_blocking=True),
    )


def apply_logit_bias(
    logits: torch.Tensor,
    biases: Sequence[Sequence[tuple[int, float]]],
    rows: Sequence[int],
) -> None:
    """logits[rows[i], token] += bias for each (token, bias) of biases[i] (OpenAI's
    logit_bias); ids outside the vocabulary are dropped, as in `flatten_token_ids`."""
    # logits: [S, V]
    count = sum(len(b) for b in biases)
    if not count:
        return
    toks = np.fromiter((t for b in biases for t, _ in b), dtype=np.int64, count=count)  # [T]
    values = np.fromiter((v for b in biases for _, v in b), dtype=np.float32, count=count)
    lengths = np.fromiter((len(b) for b in biases), dtype=np.int64, count=len(biases))
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), lengths)  # [T]
    keep = (toks >= 0) & (toks < logits.shape[1])
    device = logits.device
    r = torch.from_numpy(row_ids[keep]).to(device, non_blocking=True)
    t = torch.from_numpy(toks[keep]).to(device, non_blocking=True)
    v = torch.from_numpy(values[keep]).to(device, non_blocking=True)
    # Each (row, token) appears once (SamplingParams refuses a token named twice).
    logits.index_put_((r, t), v.to(logits.dtype), accumulate=True)


def keep_only_tokens(
    logits: torch.Tensor, allowed: Sequence[Sequence[int]], rows: torch.Tensor
) -> None:
    """logits[rows[i]] = -inf everywhere but at allowed[i]'s ids (vLLM's allowed_token_ids).
    Costs a [len(rows), V] mask: only rows that ask for it pay."""
    # logits: [S, V]; rows: [R] int64 on the logits' device
    if not allowed:
        return
    local, toks = flatten_token_ids(allowed, range(len(allowed)), logits.shape[1], logits.device)
    blocked = torch.ones(len(allowed), logits.shape[1], dtype=torch.bool, device=logits.device)
    blocked.index_put_((local, toks), blocked.new_zeros(()))
    kept = logits.index_select(0, rows).masked_fill_(blocked, float("-inf"))
    logits.index_copy_(0, rows, kept)


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, toks: torch.Tensor) -> None:
    """Set logits[rows[j], toks[j]] = -inf (min_tokens: stop and EOS ids may not end the text)."""
    # logits: [S, V]; rows, toks: [T]
    if rows.numel():
        # new_full fills on the logits' device: no host tensor to copy over.
        logits.index_put_((rows, toks), logits.new_full((), float("-inf")))


def apply_repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, toks: torch.Tensor, penalty: torch.Tensor
) -> None:
    """HF / vLLM repetition penalty over every seen (prompt and output) token.

    A seen token's positive logit is divided by the row's penalty, a negative one multiplied, so
    penalty > 1 always makes it less likely. Duplicate pairs are harmless: each writes the same
    value, computed from the original logit.
    """
    # logits: [S, V]; rows, toks: [T]; penalty: [S] (1.0 where the row has none)
    if not rows.numel():
        return
    seen = logits[rows, toks]  # [T]
    p = penalty[rows]  # [T]
    logits[rows, toks] = torch.where(seen > 0, seen / p, seen * p)


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    toks: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> None:
    """OpenAI penalties over output tokens: logit -= presence * [count > 0] + frequency * count."""
    # logits: [S, V]; rows, toks: [T] output tokens; presence, frequency: [S]
    if not rows.numel():
        return
    if logits.device.type != "cpu":
        # `unique` has a data-dependent size: a host sync on a device. Dense [S, V] counts
        # instead: fixed shapes, and cheap there (on the CPU the sparse form below is faster).
        dense = torch.zeros_like(logits)  # [S, V]
        dense.index_put_((rows, toks), logits.new_ones(()).expand(rows.shape), accumulate=True)
        logits.sub_(presence[:, None] * (dense > 0) + frequency[:, None] * dense)
        return
    vocab_size = logits.shape[1]
    flat, counts = torch.unique(rows * vocab_size + toks, return_counts=True)  # [U], [U]
    r = flat // vocab_size
    delta = presence[r] + frequency[r] * counts.to(logits.dtype)  # [U]
    logits.view(-1).index_add_(0, flat, -delta)
