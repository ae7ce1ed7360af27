"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p, penalties, min_tokens, logprobs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine import sampler as sampler_mod
from kvrelay.engine import sampling_ops
from kvrelay.engine.penalties import (
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    flatten_token_ids,
)
from kvrelay.engine.sampler import Sampler, SamplingRow
from kvrelay.engine.sampling_ops import sample_inverse_cdf, truncation_threshold

EOS = 2


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: tuple[int, ...] = (EOS,),
) -> SamplingRow:
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, list(prompt), list(output), gen, eos)


# --- greedy ---------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31), rows=st.integers(1, 8), vocab=st.integers(2, 300))
@settings(max_examples=40, deadline=None)
def test_greedy_is_argmax_lowest_index_on_ties(seed: int, rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Few distinct values, so ties are common.
    logits = torch.randint(0, 4, (rows, vocab), generator=g).float()
    out = Sampler()(logits, [row(SamplingParams.greedy()) for _ in range(rows)])
    for r in range(rows):
        best = max(logits[r].tolist())
        assert out.token_ids[r] == logits[r].tolist().index(best)
    assert out.logprobs == [None] * rows


def test_sampler_leaves_logits_untouched_and_checks_shape() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, min_tokens=2)
    Sampler()(logits, [row(params, [1, 2, 3], [4]) for _ in range(3)])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(logits, [row(params)])


# --- seeded reproducibility ------------------------------------------------------------------


def _run_seeded(seed: int, steps: int, others: int, position: int, vocab: int = 500) -> list[int]:
    """Tokens of one seeded row over `steps`, amid `others` unseeded random rows."""
    params = SamplingParams(
        temperature=0.9, top_k=60, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
        presence_penalty=0.3, frequency_penalty=0.2, seed=seed, max_tokens=None,
    )  # fmt: skip
    target = row(params, prompt=[5, 6, 7])
    own_logits = torch.Generator().manual_seed(1234)  # the row's logits: same every run
    noise = torch.Generator().manual_seed(seed * 7 + others * 13 + position)  # others: differ
    sampler = Sampler(torch.Generator().manual_seed(others + position))
    other_params = [
        SamplingParams(temperature=1.3, top_p=0.5 + 0.1 * i % 0.5, top_k=i % 7)
        for i in range(others)
    ]
    outputs: list[list[int]] = [[] for _ in range(others)]
    tokens: list[int] = []
    for _ in range(steps):
        x = torch.randn(1, vocab, generator=own_logits) * 3
        batch = torch.randn(others + 1, vocab, generator=noise) * 3
        batch[position] = x[0]
        rows = [row(p, [1, 2], o) for p, o in zip(other_params, outputs, strict=True)]
        rows.insert(
            position,
            SamplingRow(params, target.prompt_token_ids, tokens[:], target.generator, (EOS,)),
        )
        out = sampler(batch, rows)
        tokens.append(out.token_ids[position])
        for i, t in enumerate(out.token_ids[:position] + out.token_ids[position + 1 :]):
            outputs[i].append(t)
    return tokens


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    alone = _run_seeded(seed=42, steps=40, others=0, position=0)
    assert len(set(alone)) > 5  # really sampling, not collapsing to one token
    assert _run_seeded(seed=42, steps=40, others=5, position=3) == alone
    assert _run_seeded(seed=42, steps=40, others=9, position=9) == alone
    assert _run_seeded(seed=42, steps=40, others=2, position=0) == alone


def test_different_seeds_differ() -> None:
    assert _run_seeded(seed=1, steps=30, others=0, position=0) != _run_seeded(
        seed=2, steps=30, others=0, position=0
    )


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    logits = torch.randn(16, 200)
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(16)]
    a = Sampler(torch.Generator().manual_seed(3))(logits, rows).token_ids
    b = Sampler(torch.Generator().manual_seed(3))(logits, rows).token_ids
    c = Sampler(torch.Generator().manual_seed(4))(logits, rows).token_ids
    assert a == b
    assert a != c


# --- top-k / top-p / min-p -------------------------------------------------------------------


def reference_allowed(x: list[float], top_k: int, top_p: float, min_p: float) -> set[int] | None:
    """Plain-Python kept set (x already temperature-scaled); None if a boundary is ambiguous."""
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if 0 < top_k < len(x):
        order = order[:top_k]
    m = max(x[i] for i in order)
    w = [math.exp(x[i] - m) for i in order]
    total = sum(w)
    kept, above = [], 0.0
    for i, wi in zip(order, w, strict=True):
        p = wi / total
        if abs(above - top_p) < 1e-4 and top_p < 1.0:
            return None  # too close to call in float32
        if top_p >= 1.0 or above < top_p:
            kept.append(i)
        above += p
    pmax = max(math.exp(x[i] - m) for i in kept) / total
    return {i for i in kept if math.exp(x[i] - m) / total >= min_p * pmax - 1e-9}


@given(
    seed=st.integers(0, 2**31),
    vocab=st.integers(2, 400),
    scale=st.sampled_from([0.3, 1.0, 3.0, 8.0]),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 40, 1000]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    candidates=st.sampled_from([1, 4, 128]),
)
@settings(max_examples=300, deadline=None)
def test_truncation_mask_matches_reference(
    seed: int, vocab: int, scale: float, top_k: int, top_p: float, min_p: float, candidates: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, vocab, generator=g) * scale  # [3, V]
    # Few candidates force the full-sort fallback for top-p rows; many take the fast path.
    old = sampling_ops.TOP_P_CANDIDATES
    sampling_ops.TOP_P_CANDIDATES = candidates
    try:
        k_on = min(top_k, vocab) if top_k > 0 else vocab  # >= V: off
        k = torch.tensor([k_on, vocab, k_on])
        p = torch.tensor([top_p, top_p, 1.0])
        mp = torch.tensor([min_p, 0.0, min_p])
        thresh = truncation_threshold(x, k, p, mp)
    finally:
        sampling_ops.TOP_P_CANDIDATES = old
    settings_per_row = [(top_k, top_p, min_p), (0, top_p, 0.0), (top_k, 1.0, min_p)]
    for r, (kk, pp, mm) in enumerate(settings_per_row):
        expected = reference_allowed(x[r].tolist(), kk, pp, mm)
        if expected is None:
            continue
        got = set((x[r] >= thresh[r]).nonzero().flatten().tolist())
        assert got == expected, (r, kk, pp, mm)


def test_sampled_tokens_lie_in_allowed_set() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g)
    n = 4000
    cases = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=20, top_p=0.8, min_p=0.1),
    ]
    for params in cases:
        allowed = reference_allowed(
            (base / params.temperature).tolist(), params.top_k, params.top_p, params.min_p
        )
        assert allowed is not None and len(allowed) > 1
        out = Sampler(torch.Generator().manual_seed(1))(
            base.expand(n, -1).clone(), [row(params) for _ in range(n)]
        )
        seen = set(out.token_ids)
        assert seen <= allowed, params
        assert seen == allowed, params  # every allowed token turns up in 4000 draws


def test_sampling_follows_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    temperature, n = 0.8, 40_000
    expected = torch.softmax(logits.double() / temperature, dim=-1) * n
    out = Sampler(torch.Generator().manual_seed(0))(
        logits.expand(n, -1).clone(), [row(SamplingParams(temperature=temperature))] * n
    )
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_seeded_row_over_steps_follows_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.5, -1.0]])
    gen = torch.Generator().manual_seed(9)
    params = SamplingParams(temperature=1.0, seed=9)
    sampler = Sampler()
    counts = [0] * 4
    steps = 4000
    for _ in range(steps):
        counts[sampler(logits, [SamplingRow(params, [], [], gen, ())]).token_ids[0]] += 1
    expected = torch.softmax(logits[0].double(), dim=-1) * steps
    chi2 = float(((torch.tensor(counts).double() - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


@given(
    probs=st.lists(
        st.sampled_from([0.0, 0.0, 1e-30, 1e-6, 0.3, 1.0, 7.0]), min_size=1, max_size=30
    ),
    u=st.sampled_from([0.0, 1e-9, 0.5, 0.999999, 1.0 - 2**-24]),
)
def test_inverse_cdf_never_returns_zero_probability_token(probs: list[float], u: float) -> None:
    if sum(probs) == 0:
        return
    tok = int(sample_inverse_cdf(torch.tensor([probs]), torch.tensor([u]))[0])
    assert probs[tok] > 0


# --- penalties and min_tokens ----------------------------------------------------------------


def test_penalties_match_reference() -> None:
    vocab = 12
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=g) * 2
    prompts = [[1, 1, 3, 40], [], [7]]  # 40 is outside the vocabulary: ignored
    outputs = [[3, 5, 5, 5], [0, 0, 11], []]
    rep, pres, freq = [1.3, 1.0, 0.5], [0.5, -1.0, 2.0], [0.25, 0.7, 1.0]
    x = logits.clone()
    r, t = flatten_token_ids(prompts + outputs, [0, 1, 2] * 2, vocab, x.device)
    apply_repetition_penalty(x, r, t, torch.tensor(rep))
    r, t = flatten_token_ids(outputs, [0, 1, 2], vocab, x.device)
    apply_presence_frequency_penalties(x, r, t, torch.tensor(pres), torch.tensor(freq))
    for i in range(3):
        for tok in range(vocab):
            v = float(logits[i, tok])
            if tok in prompts[i] or tok in outputs[i]:
                v = v / rep[i] if v > 0 else v * rep[i]
            c = outputs[i].count(tok)
            v -= pres[i] * (c > 0) + freq[i] * c
            assert float(x[i, tok]) == pytest.approx(v, abs=1e-6), (i, tok)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    sampler = Sampler()
    assert sampler(logits, [row(SamplingParams.greedy(), output=[1])]).token_ids == [1]
    # repetition over the prompt alone: 3.0 / 1.1 < 2.9
    assert sampler(logits, [row(SamplingParams.greedy(repetition_penalty=1.1), [1])]).token_ids == [
        2
    ]
    # presence applies to output only: prompt tokens are not penalised
    assert sampler(logits, [row(SamplingParams.greedy(presence_penalty=0.5), [1])]).token_ids == [1]
    assert sampler(
        logits, [row(SamplingParams.greedy(presence_penalty=0.5), [], [1])]
    ).token_ids == [2]
    # frequency scales with the count: 3 - 2*0.4 = 2.2 < 2.9 - 0.4 = 2.5
    p = SamplingParams.greedy(frequency_penalty=0.4)
    assert sampler(logits, [row(p, [], [1, 1, 2])]).token_ids == [2]
    assert sampler(logits, [row(p, [], [1, 2, 2])]).token_ids == [1]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos: bool) -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0, 2.0]])  # EOS=2 best, stop id 3 next
    params = SamplingParams.greedy(min_tokens=3, stop_token_ids=[3], ignore_eos=ignore_eos)
    sampler = Sampler()
    assert sampler(logits, [row(params, [9], [0, 0])]).token_ids == [4]
    assert sampler(logits, [row(params, [9], [0, 0, 0])]).token_ids == [EOS]
    # Several EOS ids (e.g. <|im_end|> and <|endoftext|>) are all masked.
    assert sampler(logits, [row(params, [], [0], eos=(2, 4))]).token_ids == [5]
    # Sampled rows too: the masked tokens never come out.
    hot = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[3])
    out = Sampler(torch.Generator().manual_seed(0))(
        logits.expand(500, -1).clone(), [row(hot)] * 500
    )
    assert not {2, 3} & set(out.token_ids)


# --- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_moves_the_greedy_choice_and_bans_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    sampler = Sampler()
    assert sampler(logits, [row(SamplingParams.greedy(logit_bias={3: 4.5}))]).token_ids == [3]
    assert sampler(logits, [row(SamplingParams.greedy(logit_bias={1: -0.2}))]).token_ids == [2]
    # -100 bans a token in practice, even when sampling hot: it never comes out.
    hot = SamplingParams(temperature=2.0, logit_bias={1: -100, 2: -100})
    out = Sampler(torch.Generator().manual_seed(0))(
        logits.expand(400, -1).clone(), [row(hot)] * 400
    )
    assert {1, 2}.isdisjoint(out.token_ids) and {0, 3} <= set(out.token_ids)


def test_logit_bias_applies_to_its_own_row_before_the_penalties() -> None:
    """vLLM's order: bias, then penalties (a biased token's logit is what the penalty sees)."""
    logits = torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.0, 2.0, 0.5, 0.0]])
    biased = SamplingParams.greedy(logit_bias=[(2, 1.8)], repetition_penalty=2.0)
    plain = SamplingParams.greedy()
    # Row 0: token 2 -> 2.3, then the penalty over prompt token 2 -> 1.15 < 2.0: token 1 wins.
    # Without the penalty it would be token 2; row 1 (no bias) is untouched: token 1.
    out = Sampler()(logits, [row(biased, prompt=[2]), row(plain)])
    assert out.token_ids == [1, 1]
    no_penalty = SamplingParams.greedy(logit_bias=[(2, 1.8)])
    assert Sampler()(logits, [row(no_penalty, prompt=[2]), row(plain)]).token_ids == [2, 1]


def test_logit_bias_ids_outside_the_vocabulary_change_nothing() -> None:
    """The engine refuses them; the sampler still never indexes past its logits."""
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    out = Sampler()(
        logits,
        [row(SamplingParams.greedy(logit_bias={1: -5.0, 3: 100.0, 2**63 - 1: 100.0}, logprobs=1))],
    )
    assert out.token_ids == [2]
    lp = out.logprobs[0]  # logprobs stay the raw model's, as vLLM returns them
    assert lp is not None
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert lp.token_logprob == pytest.approx(float(raw[0, 2]), abs=1e-6)


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits() -> None:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 100, generator=g) * 2
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0, logprobs=5),
        SamplingParams.greedy(logprobs=0, presence_penalty=1.0),
        SamplingParams(temperature=1.0),
        SamplingParams.greedy(logprobs=20),
    ]
    out = Sampler(torch.Generator().manual_seed(0))(
        logits, [row(p, [1, 2, 3], [4, 5]) for p in params]
    )
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i, k in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_logprob == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-5)
        assert len(lp.top) == k
        row_lp = raw[i].tolist()
        ref = sorted(range(100), key=lambda t: -row_lp[t])[:k]
        assert [t for t, _ in lp.top] == ref
        for t, v in lp.top:
            assert v == pytest.approx(float(raw[i, t]), abs=1e-5)


# --- fp32 limits, uniforms drawn first, invalid rows -------------------------------------------


def _big_logits(rows: int, vocab: int = 64) -> torch.Tensor:
    """Logits of magnitude up to ~1e4, token 3 positive in every row."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 3e3
    x[:, 3] = 50.0
    return x


@pytest.mark.parametrize(
    ("penalty", "bound"),
    [
        (1e-300, sampler_mod.MIN_REPETITION_PENALTY),
        (1e-40, sampler_mod.MIN_REPETITION_PENALTY),
        (1e300, sampler_mod.MAX_REPETITION_PENALTY),
    ],
)
def test_extreme_repetition_penalty_is_clamped(penalty: float, bound: float) -> None:
    """fp32 rounds 1e-40 to 0 (logit / 0 = inf -> NaN -> an out-of-vocabulary id): the sampler
    applies the bound instead, and a tiny penalty strongly favours a seen token, as it means."""
    logits = _big_logits(3)
    seen = [3, 7, 9]

    def sample(p: float) -> list[int]:
        rows = [
            row(SamplingParams(temperature=1.0, repetition_penalty=p, seed=1), seen, [3]),
            row(SamplingParams(temperature=1.0, repetition_penalty=p, top_k=5, seed=2), seen),
            row(SamplingParams(temperature=0.0, repetition_penalty=p, min_tokens=2), seen),
        ]
        return Sampler(torch.Generator().manual_seed(0))(logits, rows).token_ids

    tokens = sample(penalty)
    assert tokens == sample(bound)
    assert all(0 <= t < 64 for t in tokens)
    if penalty < 1:
        assert tokens[0] == 3  # the one seen positive logit, multiplied by 2**20


def test_huge_temperature_is_clamped_and_masked_tokens_stay_out() -> None:
    """1e300 is inf in fp32 and -inf / inf = NaN for masked logits; clamped, it is uniform."""
    logits = _big_logits(2)
    params = SamplingParams(temperature=1e300, top_k=5, min_tokens=3, stop_token_ids=[4])
    rows = [row(dataclasses.replace(params, seed=s)) for s in (1, 2)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows).token_ids
    clamped = dataclasses.replace(params, temperature=sampler_mod.MAX_TEMPERATURE)
    rows = [row(dataclasses.replace(clamped, seed=s)) for s in (1, 2)]
    assert out == Sampler(torch.Generator().manual_seed(0))(logits, rows).token_ids
    top5 = [set(r.topk(5).indices.tolist()) - {EOS, 4} for r in logits]
    assert all(t in allowed for t, allowed in zip(out, top5, strict=True))


def test_a_row_sampled_alone_with_its_uniform_matches_the_batch() -> None:
    """What isolation relies on: uniforms are drawn before any arithmetic, and re-sampling
    one row with its uniform gives its batched token without advancing any generator."""
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=11, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.2, seed=12, top_k=20, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, min_p=0.05, logprobs=2),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
    ]
    rows = [row(p, [1, 5, 9], [7, 7]) for p in params]
    sampler = Sampler(torch.Generator().manual_seed(0))
    uniforms = sampler.draw_uniforms(rows)
    state = [r.generator.get_state() for r in rows if r.generator is not None]
    batched = sampler.sample(logits, rows, uniforms)
    for i in range(len(rows)):
        alone = sampler.sample(logits[i : i + 1], rows[i : i + 1], uniforms[i : i + 1])
        assert alone.token_ids == batched.token_ids[i : i + 1]
        assert alone.logprobs == batched.logprobs[i : i + 1]
    after = [r.generator.get_state() for r in rows if r.generator is not None]
    assert all(torch.equal(a, b) for a, b in zip(state, after, strict=True))
    fresh = [row(p, [1, 5, 9], [7, 7]) for p in params]
    assert Sampler(torch.Generator().manual_seed(0))(logits, fresh) == batched


def test_non_finite_logits_raise_instead_of_an_out_of_vocabulary_token() -> None:
    logits = torch.randn(2, 32)
    logits[1] = float("nan")
    rows = [row(SamplingParams(temperature=1.0, seed=1)) for _ in range(2)]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(logits, rows)
