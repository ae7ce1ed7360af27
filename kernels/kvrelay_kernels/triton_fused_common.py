"""What the fused element-wise kernels (triton_norm, triton_activation, triton_rope_kv) share:
rounding to an output dtype that is the same interpreted and compiled, and row alignment hints.

triton 3.9's interpreter converts fp32 to bf16 by truncation (and its explicit "rtne" mode
rounds ties away from zero), while the GPU and torch round to nearest even: a bf16 kernel
tested on the CPU would then disagree with torch in about half its elements. `round_to` does
the bf16 rounding in integer ops, exactly as `c10::BFloat16` does, so interpreted and compiled
kernels round alike; fp16 and fp32 use the plain conversion (correct in both).

Row strides are not specialized (a new batch size must not recompile a kernel), so Triton no
longer knows they are multiples of 16 and would load element by element; the launches pass
`alignment(stride)` as a constexpr instead (a model constant), which the kernels state with
`tl.multiple_of`, so loads stay 16-byte vectors. Imported lazily, like `triton_write_kv`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The most a row offset is hinted to be a multiple of (in elements): 16 covers a 16-byte vector
# of every dtype.
MAX_ALIGN = 16


def alignment(*strides: int) -> int:
    """The largest power of two up to MAX_ALIGN dividing every stride (0 is divided by all)."""
    align = MAX_ALIGN
    while align > 1 and any(s % align for s in strides):
        align //= 2
    return align


@triton.jit
def to_bf16_rtne(x):  # type: ignore[no-untyped-def]  # triton params
    """fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (c10's `round_to_nearest_even`)."""
    bits = x.to(tl.uint32, bitcast=True)
    # Adding 0x7FFF, plus 1 when the kept lsb is odd, carries into the kept half exactly when
    # the dropped half is above the tie, or at the tie with an odd lsb. Inf stays inf.
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]  # triton params
    """`x` (any float type) rounded to nearest even in `dtype` (fp32, fp16 or bf16)."""
    # A constexpr test: only the chosen conversion is compiled.
    return to_bf16_rtne(x.to(tl.float32)) if dtype == tl.bfloat16 else x.to(dtype)
