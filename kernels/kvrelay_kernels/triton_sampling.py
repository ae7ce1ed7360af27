"""Triton sampler: temperature, top-k, top-p, min-p and the inverse-CDF draw of every
non-greedy row in ONE launch, one program per row, the vocabulary read in tiles.

The torch path (services/kvrelay/engine/sampling_ops.py: `truncation_threshold`,
`top_p_threshold`, `sample_inverse_cdf`) launches ~12 kernels per step for plain temperature
sampling and ~40 with top-k / top-p / min-p; this kernel is its semantics per row:

- x / temperature (IEEE division, like `x.div_(temp)`);
- min-p threshold: row max + log(min_p) (-inf when min_p is 0);
- top-k threshold: the k-th largest value, found exactly by bisection over the floats'
  order-preserving integer keys: the largest v with count(x >= v) >= k (off when k >= V);
- top-p threshold among the top-k-kept tokens: the smallest row value v with
  mass(x > v) < top_p * mass(kept), bisection again; this is `top_p_threshold`'s rule (a
  token is kept when the mass strictly above it is < top_p), and ties at it are all kept;
- the kept set is x >= max of the three thresholds; the draw is the first kept index whose
  running sum of exp(x - max), accumulated in fp64, exceeds u * total; never a
  zero-probability token; clamped to the last kept token when rounding leaves none above.

Where it can differ from the torch path (only for tokens on a boundary, by fp32 rounding):
the top-p masses are summed in tile order here, sequentially over the sorted candidates there,
so a token whose mass-above sits within rounding of top_p * mass may be kept by one and not
the other; the draw sums exp(x - max) where torch sums softmax probabilities (each divided by
the row sum and rounded), so a uniform within rounding of a CDF step may pick the neighbour;
exp and log on the GPU are libdevice's, torch's CPU ones may differ in the last bit.

Cost: each bisection is 32-33 passes over the row (only rows that use top-k / top-p run
them); the others read the row 3-4 times. Imported lazily, like `triton_write_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Vocabulary tile per loop iteration and the warps of a row's program.
BLOCK = 1024
NUM_WARPS = 4
MAX_VOCAB = 2**20  # keys and indices stay well inside int32


@triton.jit
def _key(x):  # type: ignore[no-untyped-def]  # triton params
    """fp32 -> int32 whose signed order is the floats' order (negatives: magnitude flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unkey(key):  # type: ignore[no-untyped-def]  # triton params
    """The inverse of `_key` (the map is its own inverse on the bits)."""
    k = key.to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _tile(x_row, start, vocab, temp, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Columns start..start+BLOCK of the row divided by the temperature (-inf past the end)."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(x_row + cols, mask=mask, other=float("-inf"))
    return tl.math.div_rn(x, temp), cols, mask


@triton.jit
def _exp(x, LIBDEVICE_EXP: tl.constexpr):  # type: ignore[no-untyped-def]  # triton params
    # On the GPU tl.exp is ex2.approx, several ulp off; libdevice's expf is torch's CUDA exp.
    # (A constexpr test: the interpreter, which lacks libdevice, never meets that branch.)
    return libdevice.exp(x) if LIBDEVICE_EXP else tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE_EXP: tl.constexpr):  # type: ignore[no-untyped-def]  # triton params
    # As `_exp`: libdevice's logf on the GPU (tl.log is lg2.approx there).
    return libdevice.log(x) if LIBDEVICE_EXP else tl.log(x)


@triton.jit
def _top_k_threshold(  # type: ignore[no-untyped-def]  # triton params
    x_row, vocab, temp, k, row_max, BLOCK: tl.constexpr
):
    """The k-th largest scaled value: the largest key v with count(key >= v) >= k."""
    lo = tl.full((), -(2**31), tl.int64)  # count(>= lo) = vocab >= k
    hi = _key(row_max).to(tl.int64) + 1  # count(>= hi) = 0 < k
    for _ in range(32):  # the range starts below 2**32 wide: 32 halvings leave hi = lo + 1
        mid = lo + (hi - lo) // 2
        count = tl.zeros((), tl.int64)
        for start in range(0, vocab, BLOCK):
            x, _cols, mask = _tile(x_row, start, vocab, temp, BLOCK)
            count += tl.sum(((_key(x).to(tl.int64) >= mid) & mask).to(tl.int64), axis=0)
        big = count >= k
        lo = tl.where(big, mid, lo)
        hi = tl.where(big, hi, mid)
    return _unkey(lo)


@triton.jit
def _mass_above(  # type: ignore[no-untyped-def]  # triton params
    x_row, vocab, temp, row_max, floor, above, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr
):
    """Sum of exp(x - max) over tokens with x >= floor and key(x) > above (fp32)."""
    mass = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        x, _cols, mask = _tile(x_row, start, vocab, temp, BLOCK)
        sel = mask & (x >= floor) & (_key(x).to(tl.int64) > above)
        mass += tl.sum(tl.where(sel, _exp(x - row_max, LIBDEVICE_EXP), 0.0), axis=0)
    return mass


@triton.jit
def _top_p_threshold(  # type: ignore[no-untyped-def]  # triton params
    x_row, vocab, temp, top_p, row_max, floor, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr
):
    """Smallest key v with mass(x > v) < top_p * mass(kept), kept = x >= floor (top-k)."""
    below = tl.full((), -(2**31) - 1, tl.int64)
    need = top_p * _mass_above(x_row, vocab, temp, row_max, floor, below, BLOCK, LIBDEVICE_EXP)
    lo = below  # mass(> lo) = mass(kept) >= need: fails
    hi = _key(row_max).to(tl.int64)  # mass(> max) = 0 < need: holds
    for _ in range(33):  # below 2**32 + 1 wide: 33 halvings leave hi = lo + 1
        mid = lo + (hi - lo) // 2
        m = _mass_above(x_row, vocab, temp, row_max, floor, mid, BLOCK, LIBDEVICE_EXP)
        ok = m < need
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return _unkey(hi)


@triton.jit
def _draw(  # type: ignore[no-untyped-def]  # triton params
    x_row, vocab, temp, u, row_max, thresh, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr
):
    """First kept index whose fp64 running sum of exp(x - max) exceeds u * total; the last
    positive kept index when rounding leaves none above; vocab when no token has mass."""
    total = tl.zeros((), tl.float64)
    for start in range(0, vocab, BLOCK):
        x, cols, mask = _tile(x_row, start, vocab, temp, BLOCK)
        p = tl.where(mask & (x >= thresh), _exp(x - row_max, LIBDEVICE_EXP), 0.0)
        total += tl.sum(p.to(tl.float64), axis=0)
    target = u.to(tl.float64) * total
    carry = tl.zeros((), tl.float64)
    first = tl.full((), vocab, tl.int32)
    last = tl.full((), -1, tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols, mask = _tile(x_row, start, vocab, temp, BLOCK)
        p = tl.where(mask & (x >= thresh), _exp(x - row_max, LIBDEVICE_EXP), 0.0)
        cum = carry + tl.cumsum(p.to(tl.float64), axis=0)
        hit = (cum > target) & (p > 0.0)
        first = tl.minimum(first, tl.min(tl.where(hit, cols, vocab), axis=0))
        last = tl.maximum(last, tl.max(tl.where(p > 0.0, cols, -1), axis=0))
        carry += tl.sum(p.to(tl.float64), axis=0)
    return tl.where(first < vocab, first, tl.where(last >= 0, last, vocab))


@triton.jit(do_not_specialize=["stride_x"])
def _sample_rows_kernel(  # type: ignore[no-untyped-def]  # triton params
    x_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    out_ptr,
    stride_x,
    vocab,
    BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    temp = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    row_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        x, _cols, _mask = _tile(x_row, start, vocab, temp, BLOCK)
        row_max = tl.maximum(row_max, tl.max(x, axis=0))
    # min-p: p_i >= min_p * p_max  <=>  x_i >= max + log(min_p); log(0) = -inf: off.
    thresh = row_max + _log(min_p, LIBDEVICE_EXP)
    t_k = tl.full((), float("-inf"), tl.float32)
    if k < vocab:
        t_k = _top_k_threshold(x_row, vocab, temp, k, row_max, BLOCK)
    thresh = tl.maximum(thresh, t_k)
    if top_p < 1.0:
        t_p = _top_p_threshold(x_row, vocab, temp, top_p, row_max, t_k, BLOCK, LIBDEVICE_EXP)
        thresh = tl.maximum(thresh, t_p)
    u = tl.load(u_ptr + row)
    token = _draw(x_row, vocab, temp, u, row_max, thresh, BLOCK, LIBDEVICE_EXP)
    tl.store(out_ptr + row, token.to(tl.int64))


def kernel_constants(libdevice_exp: bool, block: int = BLOCK) -> dict[str, int]:
    """The kernel's constexpr arguments. The vocabulary is a plain int, not one of them: the
    loops' trip count needs no constant, and one compile serves every model."""
    return {"BLOCK": block, "LIBDEVICE_EXP": int(libdevice_exp)}


def _check(x: torch.Tensor, params: dict[str, torch.Tensor]) -> None:
    """What the kernel would crash on or misread, from shapes, dtypes and devices (no sync)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(
            f"x must be fp32 [R, V] with a contiguous last dim, got {x.dtype} "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if not 0 < x.shape[1] <= MAX_VOCAB:
        raise ValueError(f"vocabulary {x.shape[1]} is outside 1..{MAX_VOCAB}")
    for name, t in params.items():
        want = (torch.int32, torch.int64) if name == "top_k" else (torch.float32,)
        if t.shape != (x.shape[0],) or t.dtype not in want or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{x.shape[0]}] of {want}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def sample_rows(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row: temperature, top-k, top-p, min-p and the draw, in one launch.

    Args:
        x: `[R, V]` fp32 logits (penalties applied), last dim contiguous; not modified.
        temperature: `[R]` fp32, > 0 (greedy rows are the caller's argmax).
        top_k: `[R]` int32 / int64; >= V is off.
        top_p: `[R]` fp32 in (0, 1]; 1 is off.
        min_p: `[R]` fp32 in [0, 1]; 0 is off.
        uniforms: `[R]` fp32 in [0, 1), one per row.

    Returns:
        `[R]` int64 token ids on x's device (V for a row with no finite logit, as the torch
        path's NaN draw gives, so the caller's range check refuses it).

    Raises:
        ValueError: shapes, dtypes or devices the kernel cannot take.
    """
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    _check(x, params | {"uniforms": uniforms})
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    _sample_rows_kernel[(rows,)](
        x,
        temperature,
        top_k,
        top_p,
        min_p,
        uniforms,
        out,
        x.stride(0),
        vocab,
        **kernel_constants(x.is_cuda, min(BLOCK, triton.next_power_of_2(vocab))),
        num_warps=NUM_WARPS,
    )
    return out
