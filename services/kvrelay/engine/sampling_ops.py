"""Batched sampling primitives: argmax, top-k / top-p / min-p thresholds, inverse-CDF draws.

Pure tensor functions over [R, V] logits; they know nothing of requests or SamplingParams.
"""

from __future__ import annotations

import torch

# Candidates taken with one topk for top-p; a row whose candidates hold less than top_p of the
# mass falls back to a full sort (slow on CPU: about 1.7 ms per 49k-vocab row).
TOP_P_CANDIDATES = 128


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax, lowest index on ties. x: [R, V] -> [R] int64."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        # numpy's argmax is SIMD on CPU, torch's is not: ~0.2 ms vs ~1.3 ms at 64 x 49152.
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def top_p_threshold(
    vals: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest logit kept by top-p, given each row's best logits sorted descending.

    vals: [R, K] descending (masked entries -inf); top_p: [R]; total: [R] sum over the whole
    row of exp(x - row max), or None when the K candidates are the whole support. A token is
    kept when the mass above it is < top_p: the smallest prefix holding top_p of the mass.
    Returns (threshold [R], covered [R] bool); covered is False where the candidates hold less
    than top_p, so the answer needs more of them.
    """
    # Sequential cumsums rather than tree reductions, so a row's answer does not depend on K,
    # which depends on the other rows in the batch (seeded rows must be batch-invariant).
    e = torch.exp(vals - vals[:, :1])  # [R, K]; vals[:, 0] is the row max
    cum = e.cumsum(dim=-1)  # [R, K]
    mass = cum[:, -1] if total is None else total  # [R]
    need = top_p * mass  # [R]
    keep = (cum - e) < need[:, None]  # [R, K]; the first token is always kept
    n_keep = keep.sum(dim=-1).clamp_min(1)  # [R]
    thresh = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)  # [R]
    return thresh, cum[:, -1] >= need


def truncation_threshold(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per-row logit threshold of top-k, then top-p, then min-p; tokens below it are dropped.

    x: [R, V] temperature-scaled logits; top_k: [R] int64 (>= V: off); top_p: [R] (1: off);
    min_p: [R] (0: off). Returns [R] on x's device (-inf where nothing is dropped). All three
    keep the best token and min-p compares probability ratios, which renormalising does not
    change, so the kept set is simply x >= max(thresholds). Ties at a threshold are all kept.

    Pass top_k, top_p and min_p on the host (CPU): which branches run is read from them, and
    on an accelerator each such read would be a host sync; they meet x on its device.
    """
    rows, vocab = x.shape
    top_k, top_p, min_p = top_k.cpu(), top_p.cpu(), min_p.cpu()  # no-ops for host tensors
    thresh = torch.full((rows,), float("-inf"), dtype=x.dtype, device=x.device)  # [R]
    use_k = top_k < vocab  # host, like every mask below that decides a branch
    use_p = top_p < 1.0
    need = use_k | use_p
    if bool(need.any()):
        idx = need.nonzero().squeeze(1)  # [Rt]
        k_rows, p_rows = top_k[idx], top_p[idx]  # [Rt]
        k_max = int(k_rows[use_k[idx]].max()) if bool(use_k[idx].any()) else 0
        n_cand = min(vocab, max(k_max, TOP_P_CANDIDATES if bool(use_p.any()) else 0))
        idx_x = _to(idx, x)
        vals = x[idx_x].topk(n_cand, dim=-1).values  # [Rt, K] descending
        # top-k: the k-th best logit (rows without top-k read column K-1 and discard it).
        kth = vals.gather(1, _to((k_rows.clamp(max=n_cand) - 1)[:, None], x)).squeeze(1)
        t = torch.where(_to(use_k[idx], x), kth, torch.full_like(kth, float("-inf")))  # [Rt]
        p_sel = use_p[idx]
        if bool(p_sel.any()):
            t = _apply_top_p(x, idx, vals, t, use_k[idx], p_rows, p_sel)
        thresh[idx_x] = t
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        m = x.amax(dim=-1) + torch.log(_to(min_p, x))  # [R]; log(0) = -inf: off
        thresh = torch.maximum(thresh, m)
    return thresh


def _to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Host tensor `t` on `like`'s device, uploaded without waiting (free on the CPU)."""
    return t.to(like.device, non_blocking=True)


def _apply_top_p(
    x: torch.Tensor,
    idx: torch.Tensor,
    vals: torch.Tensor,
    thresh_k: torch.Tensor,
    has_k: torch.Tensor,
    top_p: torch.Tensor,
    p_sel: torch.Tensor,
) -> torch.Tensor:
    # x: [R, V]; vals: [Rt, K] and thresh_k: [Rt] on x's device; idx: [Rt] rows of x behind
    # vals, has_k, top_p, p_sel: [Rt], all four on the host
    masked = vals.masked_fill(vals < thresh_k[:, None], float("-inf"))  # top-k first
    t_p, _ = top_p_threshold(masked, _to(top_p, x))
    # With top-k on, every kept token is a candidate and the candidates are the support;
    # without it, the mass of the whole row decides.
    full = p_sel & ~has_k
    if bool(full.any()):
        # Integer rows, not a boolean mask: on a device, indexing by a mask is a sync.
        rows_f = _to(full.nonzero().squeeze(1), x)  # [Rf] rows of vals
        xf = x[_to(idx[full], x)]  # [Rf, V]
        p_full = _to(top_p[full], x)
        total = torch.exp(xf - xf.amax(dim=-1, keepdim=True)).sum(dim=-1)  # [Rf]
        t_full, covered = top_p_threshold(masked[rows_f], p_full, total)
        if x.device.type == "cpu":
            short = ~covered
            if bool(short.any()):
                # Rare with real model outputs (the best candidates hold < top_p): sort whole
                # rows, only those (a 49k-vocab row sort costs ~1.7 ms on CPU).
                t_full[short], _ = top_p_threshold(
                    xf[short].sort(dim=-1, descending=True).values, p_full[short]
                )
        else:
            # On a device, asking which rows are short would be a host sync; sorting every
            # such row there is cheap, and the covered rows keep their candidates' answer.
            t_sorted, _ = top_p_threshold(xf.sort(dim=-1, descending=True).values, p_full)
            t_full = torch.where(covered, t_full, t_sorted)
        t_p[rows_f] = t_full
    return torch.where(_to(p_sel, x), torch.maximum(thresh_k, t_p), thresh_k)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from unnormalised probs [R, V] with uniforms [R] in [0, 1).

    One uniform per row (instead of an exponential race over V) because torch's CPU
    exponential_ costs ~20 ns per element: ~60 ms for 64 x 49152, against ~2 ms for this.
    Zero-probability tokens are never returned. Cumsum is float64 so that tokens far below
    float32 resolution of the running total keep their probability.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    target = uniforms.to(torch.float64)[:, None] * total  # [R, 1]
    # Strictly below the total, so the first cdf entry above target has positive mass.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [R]
