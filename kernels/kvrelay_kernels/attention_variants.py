"""The per-call attention variants every `paged_attention` takes: a sliding window and an
attention-logit soft cap (Mistral, Gemma 2 and 3), checked once here for every backend.

Meaning (the torch reference implements it): a query at position p sees the keys at positions
j with `p - sliding_window < j <= p` (transformers' `kv_idx > q_idx - sliding_window`), and
each scaled score s becomes `soft_cap * tanh(s / soft_cap)` before the softmax. None: full
causal attention, no cap. This module computes nothing; it must not import a backend.
"""

from __future__ import annotations

import math


def check_variants(sliding_window: int | None, soft_cap: float | None) -> None:
    """Raise ValueError when a window or cap is out of its domain (None is always fine)."""
    if sliding_window is not None and not (_is_number(sliding_window, int) and sliding_window >= 1):
        raise ValueError(
            f"sliding_window must be an int >= 1 (keys a query sees, itself included) or None "
            f"for full attention, got {sliding_window!r}"
        )
    if soft_cap is not None and not (
        _is_number(soft_cap, (int, float)) and math.isfinite(soft_cap) and soft_cap > 0
    ):
        raise ValueError(f"soft_cap must be a finite float > 0 or None, got {soft_cap!r}")


def _is_number(value: object, kinds: type | tuple[type, ...]) -> bool:
    """An instance of `kinds` that is not a bool (True is an int to isinstance)."""
    return isinstance(value, kinds) and not isinstance(value, bool)
