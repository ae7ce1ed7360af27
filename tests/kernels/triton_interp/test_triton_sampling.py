"""The Triton sampler (kvrelay_kernels/triton_sampling.py) in the interpreter, against the torch
path it replaces on a GPU: `truncation_threshold`, softmax, the mask and `sample_inverse_cdf`
(services/kvrelay/engine/sampling_ops.py), on the same scaled logits and uniforms.

Small vocabularies (and a small tile, so rows span several tiles) keep it quick: the kernel's
bisections make ~70 passes over a row, each an interpreted loop.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.sampling_ops import sample_inverse_cdf, truncation_threshold

TILE = 64  # several tiles per row at these vocabularies


@pytest.fixture(scope="module")
def ts():  # type: ignore[no-untyped-def]
    from kvrelay_kernels import triton_sampling

    return triton_sampling


def torch_path(
    x: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R], kept mask [R, V]) as `Sampler._sample` computes them with torch ops."""
    scaled = x / temp[:, None]
    vocab = x.shape[1]
    thresh = truncation_threshold(scaled, top_k.clamp(max=vocab).long(), top_p, min_p)
    kept = scaled >= thresh[:, None]
    probs = scaled.softmax(dim=-1) * kept
    return sample_inverse_cdf(probs, u), kept


def run(ts, x, temp, top_k, top_p, min_p, u):  # type: ignore[no-untyped-def]
    block = min(TILE, x.shape[1])
    saved = ts.BLOCK
    ts.BLOCK = block
    try:
        before = x.clone()
        out = ts.sample_rows(x, temp, top_k, top_p, min_p, u)
        assert torch.equal(x, before), "the kernel modified its logits"
        return out
    finally:
        ts.BLOCK = saved


def params(rows: int, vocab: int, k: int, p: float, m: float, t: float = 0.8):  # type: ignore[no-untyped-def]
    return (
        torch.full((rows,), t),
        torch.full((rows,), k, dtype=torch.int32),
        torch.full((rows,), p),
        torch.full((rows,), m),
    )


CASES = [  # (top_k, top_p, min_p): each alone, combined, and off
    ("random", 10**9, 1.0, 0.0),
    ("top_k", 7, 1.0, 0.0),
    ("top_p", 10**9, 0.7, 0.0),
    ("min_p", 10**9, 1.0, 0.1),
    ("k_p", 20, 0.8, 0.0),
    ("k_p_m", 30, 0.9, 0.05),
    ("k_is_v", 160, 1.0, 0.0),
    ("k1", 1, 0.5, 0.0),
]


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # min_p = 0: -inf
@pytest.mark.parametrize(("name", "k", "p", "m"), CASES, ids=[c[0] for c in CASES])
def test_tokens_match_torch_path(ts, name: str, k: int, p: float, m: float) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    rows, vocab = 6, 160
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[1, 10:20] = x[1].max()  # ties at the maximum
    x[2, ::3] = 1.25  # ties inside the kept set
    x[3, 5] = float("-inf")  # a masked token (min_tokens / bias)
    u = torch.rand(rows, generator=gen)
    u[4], u[5] = 0.0, 1.0 - 2**-24  # the ends of [0, 1)
    temp, top_k, top_p, min_p = params(rows, vocab, k, p, m)
    want, _ = torch_path(x, temp, top_k, top_p, min_p, u)
    got = run(ts, x, temp, top_k, top_p, min_p, u)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()
    if k == 1:  # the maximum (any of a tie: all are kept, as in the torch path)
        scaled = x / temp[:, None]
        assert torch.equal(scaled.gather(1, got[:, None]).squeeze(1), scaled.amax(dim=-1))


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")
def test_kept_set_is_torch_paths(ts) -> None:  # type: ignore[no-untyped-def]
    """The tokens drawn as u sweeps [0, 1) are exactly the torch path's kept set: u at the
    middle of each kept token's CDF step draws that token, and a sweep draws nothing else."""
    gen = torch.Generator().manual_seed(7)
    vocab = 96
    base = torch.randn(vocab, generator=gen) * 3
    base[40:43] = base.topk(4).values[3]  # ties at a boundary
    for k, p, m in ((6, 1.0, 0.0), (10**9, 0.6, 0.0), (9, 0.85, 0.02)):
        temp, top_k, top_p, min_p = params(1, vocab, k, p, m, t=1.3)
        u0 = torch.zeros(1)
        _, kept = torch_path(base[None], temp, top_k, top_p, min_p, u0)
        ids = kept[0].nonzero().squeeze(1).tolist()
        assert 1 < len(ids) <= 12, ids  # small enough to visit every kept token
        probs = ((base / temp[0]).softmax(-1) * kept[0]).double()
        cdf = probs.cumsum(0) / probs.sum()
        mids = torch.tensor([(cdf[i] - probs[i] / probs.sum() / 2).item() for i in ids])
        sweep = torch.linspace(0, 1 - 2**-20, 8)
        u = torch.cat([mids.float(), sweep])
        n = len(u)
        temp, top_k, top_p, min_p = params(n, vocab, k, p, m, t=1.3)
        x = base.expand(n, vocab).contiguous()
        tokens = run(ts, x, temp, top_k, top_p, min_p, u)
        assert tokens[: len(ids)].tolist() == ids
        assert set(tokens.tolist()) == set(ids)
        assert tokens.tolist() == torch_path(x, temp, top_k, top_p, min_p, u)[0].tolist()


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")
def test_rows_are_independent(ts) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 5, 130
    x = torch.randn(rows, vocab, generator=gen)
    u = torch.rand(rows, generator=gen)
    temp = torch.tensor([0.5, 1.0, 0.7, 2.0, 0.9])
    top_k = torch.tensor([5, 300, 40, 130, 1], dtype=torch.int64)
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.2, 0.0])
    first = run(ts, x, temp, top_k, top_p, min_p, u)
    y = x.clone()
    y[[0, 2, 4]] = torch.randn(3, vocab, generator=gen) * 5
    top_k2, top_p2 = top_k.clone(), top_p.clone()
    top_k2[0], top_p2[2] = 2, 0.1
    second = run(ts, y, temp, top_k2, top_p2, min_p, u)
    assert second[[1, 3]].tolist() == first[[1, 3]].tolist()
    want, _ = torch_path(y, temp, top_k2, top_p2, min_p, u)
    assert second.tolist() == want.tolist()


def test_rejects_bad_inputs(ts) -> None:  # type: ignore[no-untyped-def]
    x = torch.zeros(2, 8)
    temp, top_k, top_p, min_p = params(2, 8, 3, 1.0, 0.0)
    u = torch.zeros(2)
    with pytest.raises(ValueError, match="x must be fp32"):
        ts.sample_rows(x.double(), temp, top_k, top_p, min_p, u)
    with pytest.raises(ValueError, match="top_k"):
        ts.sample_rows(x, temp, top_k.float(), top_p, min_p, u)
    with pytest.raises(ValueError, match="uniforms"):
        ts.sample_rows(x, temp, top_k, top_p, min_p, torch.zeros(3))
