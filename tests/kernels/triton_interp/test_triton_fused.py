"""The fused element-wise Triton kernels (interpreted on the CPU) against the models' torch ops:
RMSNorm and residual add + RMSNorm, silu-and-mul, RoPE + KV-cache write.

Inputs are fresh random on every run (the seed is in the failure message). Where the torch
reference and the kernel perform the same roundings on the same values, the results must be
bitwise equal. Two values are computed differently and may differ in the last bits of fp32:
the mean square of RMSNorm (the kernel sums in another order) and the exponential of silu
(numpy's exp in the interpreter, libdevice's on a GPU, SLEEF's in torch). There fp32 results
get a 4-ulp tolerance, and 16-bit results must equal torch's rounding of the fp32 value or of
the same value moved by 8 ulps either way, i.e. bitwise equal except within 8 fp32 ulps of a
rounding boundary (the test also checks that such elements are rare).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.layers import GatedMLP, RMSNorm
from kvrelay.models.rope import RotaryEmbedding, apply_rope_with_torch_ops
from kvrelay_kernels import reference
from kvrelay_kernels.triton_activation import silu_and_mul
from kvrelay_kernels.triton_norm import add_rms_norm, rms_norm
from kvrelay_kernels.triton_rope_kv import rope_and_write_kv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
TOKENS = (1, 3, 17)
EPS = 1e-5
FP32_RTOL = 4 * 2.0**-23  # 4 ulps (see the module docstring); atol 0: the error is relative
NEAR_BOUNDARY = 8 * 2.0**-23  # how far an fp32 value may move before its 16-bit rounding


def _generator() -> tuple[torch.Generator, int]:
    seed = secrets.randbelow(2**31)
    return torch.Generator().manual_seed(seed), seed


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _strided_rows(values: torch.Tensor, pad: int) -> torch.Tensor:
    """`values` as a view whose rows are `pad` elements longer (NaN there), as the model's
    slices of a wider buffer are."""
    rows, width = values.shape
    buffer = torch.full((rows, width + pad), float("nan"), dtype=values.dtype)
    buffer[:, :width] = values
    return buffer[:, :width]


def _assert_rounded_alike(
    got: torch.Tensor,
    exact: torch.Tensor,
    finish: Callable[[torch.Tensor], torch.Tensor],
    seed: int,
) -> None:
    """`got` (16-bit) == `finish(exact rounded to got's dtype)`, but for elements whose fp32
    `exact` lies within NEAR_BOUNDARY of a rounding boundary, where the rounding of the value
    moved either way is accepted (see the module docstring)."""
    low = finish((exact * (1 - NEAR_BOUNDARY)).to(got.dtype))
    high = finish((exact * (1 + NEAR_BOUNDARY)).to(got.dtype))
    ambiguous = low != high
    # Rare, not 1-in-500 rare: 16-bit inputs sit on a coarse grid, and one row's scale can put
    # many of them near a boundary at once (seed 332405466: 2.75% of 3 x 2048 fp16 elements,
    # 8.7% of one row). The check guards the premise (a tolerance that accepts everything).
    assert float(ambiguous.float().mean()) < 0.10, f"too many boundary cases (seed {seed})"
    wrong = (got != low) & (got != high)
    assert not wrong.any(), (
        f"{int(wrong.sum())} of {got.numel()} elements differ (seed {seed}): first at "
        f"{wrong.nonzero()[0].tolist()}: got {got[wrong][0]}, expected {low[wrong][0]}"
    )


def _norm_inputs(
    gen: torch.Generator, tokens: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, RMSNorm]:
    """Rows of mixed scales: the last one so small that eps dominates its mean square."""
    x = _randn(gen, tokens, hidden) * 2
    x[-1] *= 1e-3
    norm = RMSNorm(hidden, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(gen, hidden))
    return x.to(dtype), norm


def _assert_norm_matches(got: torch.Tensor, x: torch.Tensor, norm: RMSNorm, seed: int) -> None:
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    if x.dtype == torch.float32:
        expected = norm.forward_with_torch_ops(x)
        torch.testing.assert_close(
            got, expected, rtol=FP32_RTOL, atol=0, msg=lambda m: f"{m} (seed {seed})"
        )
        return
    hidden = x.shape[1]
    exact = F.rms_norm(x.float(), (hidden,), None, EPS)  # the fp32 value before the rounding
    _assert_rounded_alike(got, exact, lambda h: norm.weight.detach() * h, seed)
    # The helper's own premise: torch's code is that rounding of that value.
    assert torch.equal(norm.forward_with_torch_ops(x), norm.weight.detach() * exact.to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [576, 2048, 80 * 16])
def test_rms_norm_matches_the_torch_ops(hidden: int, dtype: torch.dtype) -> None:
    for tokens in TOKENS:
        gen, seed = _generator()
        x, norm = _norm_inputs(gen, tokens, hidden, dtype)
        for view in (x, _strided_rows(x, 24)):  # contiguous, and rows 8-element aligned
            got = rms_norm(view, norm.weight.detach(), EPS)
            _assert_norm_matches(got, x, norm, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [576, 2048, 80 * 16])
def test_add_rms_norm_updates_the_residual_in_place(hidden: int, dtype: torch.dtype) -> None:
    for tokens in TOKENS:
        gen, seed = _generator()
        start, norm = _norm_inputs(gen, tokens, hidden, dtype)
        delta = (_randn(gen, tokens, hidden) * 3).to(dtype)
        expected_residual = start.clone()
        expected_residual.add_(delta)  # what `RMSNorm.add_and_norm` does first
        # Both strided: row strides hidden + 8 and hidden + 40, 8-element (not 16) aligned.
        residual = _strided_rows(start, 8)
        got = add_rms_norm(residual, _strided_rows(delta, 40), norm.weight.detach(), EPS)
        assert torch.equal(residual, expected_residual), f"residual differs (seed {seed})"
        assert residual.as_strided((tokens, 8), (hidden + 8, 1), hidden).isnan().all(), (
            "the kernel wrote past the residual's rows"
        )
        _assert_norm_matches(got, expected_residual, norm, seed)


def _silu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    # GatedMLP(1, I): the op only reads the intermediate size; a hidden size of 1 keeps its
    # (unused) weights small.
    mlp = GatedMLP(1, gate_up.shape[1] // 2)
    return mlp.silu_and_mul_with_torch_ops(gate_up)


# exp(90) overflows to inf in the interpreter's numpy, as on the GPU: silu(-90) is -0.0.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("intermediate", [1536, 1000])
def test_silu_and_mul_matches_the_torch_ops(intermediate: int, dtype: torch.dtype) -> None:
    for tokens in TOKENS:
        gen, seed = _generator()
        gate_up = _randn(gen, tokens, 2 * intermediate) * 4
        gate_up[0, :4] = torch.tensor([-90.0, 90.0, -20.0, 0.0])  # exp overflows at -90
        gate_up = gate_up.to(dtype)
        # Contiguous, and rows 3 elements apart (no 16-element row alignment).
        for view in (gate_up, _strided_rows(gate_up, 3)):
            got = silu_and_mul(view)
            assert got.shape == (tokens, intermediate) and got.is_contiguous()
            expected = _silu_reference(gate_up)
            if dtype == torch.float32:
                torch.testing.assert_close(
                    got, expected, rtol=FP32_RTOL, atol=0, msg=lambda m, s=seed: f"{m} seed {s}"
                )
                continue
            gate, up = gate_up.split(intermediate, dim=-1)
            exact = F.silu(gate.float())  # torch's fp32 silu before the rounding
            _assert_rounded_alike(got, exact, lambda s, up=up: s * up, seed)
            assert torch.equal(expected, exact.to(dtype) * up)  # the helper's premise


# (query heads, KV heads, head_dim): SmolLM2-135M, Llama-3-8B, a head_dim that is no power of 2.
ROPE_SHAPES = [(9, 3, 64), (32, 8, 128), (16, 4, 80)]


def _rope_case(
    gen: torch.Generator,
    tokens: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv with rows 16 elements longer, cos, sin, NaN-poisoned cache base, slots)."""
    h, kvh, d = shape
    qkv = _strided_rows((_randn(gen, tokens, (h + 2 * kvh) * d) * 2).to(dtype), 16)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(d, 500000.0, None, 4096).cos_sin(positions, dtype)
    # 4 blocks of 16 slots, 3 layers; the cache handed over is a view that skips layer 0 of
    # its base and the last 8 elements of every head: its strides are not the packed ones.
    base = torch.full((4, 4, 2, 16, kvh, d + 8), float("nan"), dtype=cache_dtype)
    slots = torch.randperm(4 * 16, generator=gen)[:tokens]
    if tokens > 1:
        slots[1] = -1  # a padding token: nothing cached
    return qkv, cos, sin, base, slots


def _check_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    base: torch.Tensor,
    slots: torch.Tensor,
    shape: tuple[int, int, int],
    layer: int,
    seed: int,
) -> None:
    h, kvh, d = shape
    tokens = qkv.shape[0]
    expected_base = base.clone()
    q = apply_rope_with_torch_ops(qkv[:, : h * d].view(tokens, h, d), cos, sin)
    k = apply_rope_with_torch_ops(qkv[:, h * d : (h + kvh) * d].view(tokens, kvh, d), cos, sin)
    v = qkv[:, (h + kvh) * d :].view(tokens, kvh, d)
    reference.write_kv(k, v, expected_base[:, 1:, ..., :d], layer, slots)

    got = rope_and_write_kv(qkv, cos, sin, base[:, 1:, ..., :d], layer, slots, h, kvh, d)
    assert got.shape == (tokens, h, d) and got.dtype == qkv.dtype and got.is_contiguous()
    assert torch.equal(got, q), f"rotated q differs (seed {seed})"
    # NaN == NaN here: every other layer, slot, padding token and pad column stays as it was.
    torch.testing.assert_close(
        base, expected_base, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{m} (seed {seed})"
    )
    written = int((slots >= 0).sum()) * 2 * kvh * d
    assert int((~base.isnan()).sum()) == written, f"cache writes (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_and_write_kv_is_bitwise_the_torch_ops(
    shape: tuple[int, int, int], dtype: torch.dtype
) -> None:
    for tokens in TOKENS:
        gen, seed = _generator()
        qkv, cos, sin, base, slots = _rope_case(gen, tokens, shape, dtype, dtype)
        _check_rope(qkv, cos, sin, base, slots, shape, tokens % 3, seed)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
    ],
    ids=["bf16-fp32", "fp32-bf16", "fp16-bf16", "bf16-fp16"],
)
def test_rope_and_write_kv_converts_to_the_cache_dtype(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    gen, seed = _generator()
    shape = ROPE_SHAPES[0]
    qkv, cos, sin, base, slots = _rope_case(gen, 5, shape, dtype, cache_dtype)
    _check_rope(qkv, cos, sin, base, slots, shape, 2, seed)


def test_rope_and_write_kv_with_only_padding_tokens_caches_nothing() -> None:
    gen, seed = _generator()
    shape = ROPE_SHAPES[2]
    qkv, cos, sin, base, slots = _rope_case(gen, 3, shape, torch.bfloat16, torch.bfloat16)
    _check_rope(qkv, cos, sin, base, torch.full_like(slots, -1), shape, 0, seed)
    assert base.isnan().all()


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


# Meta tensors: a wrapper that read a device value (`.item()`, `.tolist()`) would fail with
# another error than ValueError, and one whose checks missed a case would fail launching.
_X, _W = _meta(3, 64), _meta(64)
_BAD_NORM_CALLS: list[tuple[str, Callable[[], object]]] = [
    ("1-D x", lambda: rms_norm(_meta(64), _W, EPS)),
    ("int x", lambda: rms_norm(_meta(3, 64, dtype=torch.int32), _W, EPS)),
    ("strided last dim", lambda: rms_norm(_meta(64, 3).t(), _W, EPS)),
    ("weight shape", lambda: rms_norm(_X, _meta(32), EPS)),
    ("weight dtype", lambda: rms_norm(_X, _meta(64, dtype=torch.float32), EPS)),
    ("weight device", lambda: rms_norm(_X, torch.ones(64, dtype=torch.bfloat16), EPS)),
    ("too wide", lambda: rms_norm(_meta(1, 2**16), _meta(2**16), EPS)),
    ("delta shape", lambda: add_rms_norm(_X, _meta(2, 64), _W, EPS)),
    ("delta dtype", lambda: add_rms_norm(_X, _meta(3, 64, dtype=torch.float16), _W, EPS)),
    ("delta strides", lambda: add_rms_norm(_X, _meta(64, 3).t(), _W, EPS)),
    ("residual dtype", lambda: add_rms_norm(_meta(3, 64, dtype=torch.int64), _X, _W, EPS)),
    ("odd gate_up", lambda: silu_and_mul(_meta(3, 65))),
    ("3-D gate_up", lambda: silu_and_mul(_meta(3, 2, 64))),
    ("gate_up strides", lambda: silu_and_mul(_meta(64, 3).t())),
    ("gate_up dtype", lambda: silu_and_mul(_meta(3, 64, dtype=torch.float64))),
]


def _rope_call(**changes: object) -> Callable[[], object]:
    """A call of `rope_and_write_kv` on valid meta inputs (SmolLM2 shapes, 3 tokens) with
    `changes` applied."""
    args: dict[str, object] = {
        "qkv": _meta(3, 15 * 64),
        "cos": _meta(3, 1, 32),
        "sin": _meta(3, 1, 32),
        "kv_cache": _meta(4, 2, 2, 16, 3, 64),
        "layer": 1,
        "slot_mapping": _meta(3, dtype=torch.int64),
        "num_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
    }
    args.update(changes)
    return lambda: rope_and_write_kv(**args)  # type: ignore[arg-type]


_BAD_ROPE_CALLS: list[tuple[str, Callable[[], object]]] = [
    ("qkv width", _rope_call(qkv=_meta(3, 14 * 64))),
    ("qkv strides", _rope_call(qkv=_meta(15 * 64, 3).t())),
    ("qkv dtype", _rope_call(qkv=_meta(3, 15 * 64, dtype=torch.int32))),
    ("odd head_dim", _rope_call(head_dim=63)),
    ("cos shape", _rope_call(cos=_meta(3, 32))),
    ("sin tokens", _rope_call(sin=_meta(2, 1, 32))),
    ("cos dtype", _rope_call(cos=_meta(3, 1, 32, dtype=torch.float32))),
    ("sin strides", _rope_call(sin=_meta(3, 1, 64)[..., ::2])),
    ("cache heads", _rope_call(kv_cache=_meta(4, 2, 2, 16, 4, 64))),
    ("cache rank", _rope_call(kv_cache=_meta(4, 2, 16, 3, 64))),
    ("cache strides", _rope_call(kv_cache=_meta(4, 2, 2, 16, 64, 3).transpose(4, 5))),
    ("cache dtype", _rope_call(kv_cache=_meta(4, 2, 2, 16, 3, 64, dtype=torch.int8))),
    ("layer", _rope_call(layer=2)),
    ("negative layer", _rope_call(layer=-1)),
    ("slot dtype", _rope_call(slot_mapping=_meta(3, dtype=torch.int32))),
    ("slot count", _rope_call(slot_mapping=_meta(4, dtype=torch.int64))),
    ("slot device", _rope_call(slot_mapping=torch.zeros(3, dtype=torch.int64))),
]


@pytest.mark.parametrize(
    "call", [c for _, c in _BAD_NORM_CALLS + _BAD_ROPE_CALLS],
    ids=[n for n, _ in _BAD_NORM_CALLS + _BAD_ROPE_CALLS],
)  # fmt: skip
def test_wrappers_reject_what_the_kernels_cannot_take(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()
