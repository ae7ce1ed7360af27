"""The grammar's token mask on a step's logits: the sampler's first step for rows under a
structured-output constraint.

Each constrained row's matcher fills a bitmask on the host (llguidance, in parallel for
several rows; bit t set: token t allowed), which goes up in one non-blocking copy and is
unpacked on the logits' device into -inf for every refused token. Nothing is read back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch


class _Row(Protocol):
    """What this needs of a SamplingRow (sampler.py imports this module, not the reverse)."""

    @property
    def params(self) -> Any: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def matcher(self) -> Any: ...


_executor_lock = threading.Lock()
_executor: list[Any] = []  # the process's one llguidance.LLExecutor, made on first need


def masked_logits(logits: torch.Tensor, rows: Sequence[_Row], idx: list[int]) -> torch.Tensor:
    """A float32 copy of `logits` [S, V] with every token the grammar of row `idx[j]` refuses
    set to -inf (the other rows unchanged). The rows' matchers are read, never advanced.

    min_tokens is applied here for these rows, on the host bits: EOS and the stop tokens are
    refused while the row is short of min_tokens, unless they are all its grammar allows
    (the grammar's end wins: the output is complete and can take nothing else).
    """
    vocab = logits.shape[1]
    bitmask = torch.empty(
        (len(idx), (vocab + 31) // 32), dtype=torch.int32, pin_memory=logits.is_cuda
    )  # [R, W], on the host: llguidance writes it
    _fill(bitmask, [rows[i].matcher for i in idx])
    for j, i in enumerate(idx):
        row = rows[i]
        if len(row.output_token_ids) < row.params.min_tokens:
            _refuse_if_not_all(bitmask[j], (*row.params.stop_token_ids, *row.eos_token_ids))
    x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    on_device = bitmask.to(x.device, non_blocking=True)
    if len(idx) == x.shape[0]:
        apply_bitmask(x, on_device)
    else:
        # An int64 index uploaded without waiting (sampler.device_index's way; a Python list
        # index would be copied up blocking).
        rows_on_device = torch.tensor(idx, dtype=torch.int64).to(x.device, non_blocking=True)
        part = x[rows_on_device]
        apply_bitmask(part, on_device)
        x[rows_on_device] = part
    return x


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """x [R, V] (edited in place) gets -inf wherever bitmask [R, ceil(V / 32)] int32, on x's
    device, has its bit clear (token t is bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)  # [32]
    # An arithmetic shift keeps the sign bit, but & 1 reads bit 31 right all the same.
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : x.shape[1]]  # [R, V]
    x.masked_fill_(allowed == 0, float("-inf"))


def _fill(bitmask: torch.Tensor, matchers: list[Any]) -> None:
    import llguidance.torch as llt

    if len(matchers) == 1:
        llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        return
    # Several rows: llguidance computes their masks on its own threads, GIL released.
    llt.fill_next_token_bitmask_par(
        _parallel_executor(), [(m, j) for j, m in enumerate(matchers)], bitmask
    )


def _parallel_executor() -> Any:
    with _executor_lock:
        if not _executor:
            from llguidance import LLExecutor

            _executor.append(LLExecutor())
        return _executor[0]


def _refuse_if_not_all(words: torch.Tensor, tokens: Sequence[int]) -> None:
    """Clear `tokens`' bits in one row's mask `words` [W], unless nothing would be left."""
    bits = words.numpy().view(np.uint32)  # shares memory with `words`
    kept = bits.copy()
    for token in tokens:
        if 0 <= token < 32 * len(kept):
            kept[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))
    if kept.any():
        bits[:] = kept
