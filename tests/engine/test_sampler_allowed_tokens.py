"""The sampler's allowed_token_ids: only the listed ids of a row may come out, greedy or hot,
against a bias, beside min_tokens and penalties; the raw logprobs stay the model's."""

from __future__ import annotations

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.sampler import Sampler
from tests.engine.test_sampler import EOS, row


def test_allowed_token_ids_limit_their_own_row_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]] * 3)
    kept = SamplingParams.greedy(allowed_token_ids=[0, 3, 4])
    plain = SamplingParams.greedy()
    out = Sampler()(
        logits, [row(kept), row(plain), row(SamplingParams.greedy(allowed_token_ids=[3]))]
    )
    assert out.token_ids == [4, 1, 3]  # the best allowed; the plain row untouched; the only one


def test_allowed_token_ids_hold_when_sampling_hot_and_against_a_bias() -> None:
    vocab = 50
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)).expand(600, -1)
    allowed = [5, 17, 42]
    hot = SamplingParams(temperature=5.0, allowed_token_ids=allowed, logit_bias={7: 100.0})
    out = Sampler(torch.Generator().manual_seed(0))(logits.clone(), [row(hot)] * 600)
    assert set(out.token_ids) == set(allowed)  # each comes out, nothing else does


def test_allowed_token_ids_with_penalties_min_tokens_and_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 2.5, 1.0]])
    params = SamplingParams.greedy(
        allowed_token_ids=[EOS, 3, 4], min_tokens=1, repetition_penalty=2.0, logprobs=1
    )
    # EOS (token 2) is masked by min_tokens; token 3, seen in the prompt, is penalised to
    # 2.5 / 2 = 1.25 and still beats token 4's 1.0; the disallowed token 1 never comes out.
    out = Sampler()(logits, [row(params, prompt=[3])])
    assert out.token_ids == [3]
    lp = out.logprobs[0]  # the raw model's, as vLLM returns them
    assert lp is not None
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert lp.token_logprob == pytest.approx(float(raw[0, 3]), abs=1e-6)
    assert lp.top[0][0] == 1  # the raw top-1 is a token the row may not sample


def test_allowed_token_ids_outside_the_vocabulary_change_nothing() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    out = Sampler()(logits, [row(SamplingParams.greedy(allowed_token_ids=[2, 3, 2**40]))])
    assert out.token_ids == [2]
