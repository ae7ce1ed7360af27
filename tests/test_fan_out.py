"""The one n > 1 fan-out rule (kvrelay.common.messages.samples_of), which the router and the
engine both use: the same ids and parameters on both sides of the wire."""

from __future__ import annotations

from kvrelay.common.messages import samples_of
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.parent_request import ParentRequest


def test_one_sample_keeps_the_request_id_and_its_seed() -> None:
    [(sample_id, params)] = samples_of("req", SamplingParams(seed=7, max_tokens=4))
    assert (sample_id, params.n, params.seed, params.max_tokens) == ("req", 1, 7, 4)


def test_n_samples_are_requests_of_their_own_with_consecutive_seeds() -> None:
    samples = samples_of("req", SamplingParams(n=3, seed=10, temperature=0.8))
    assert [sample_id for sample_id, _ in samples] == ["req#0", "req#1", "req#2"]
    assert [p.seed for _, p in samples] == [10, 11, 12]
    assert all(p.n == 1 and p.temperature == 0.8 for _, p in samples)


def test_unseeded_samples_stay_unseeded() -> None:
    assert [p.seed for _, p in samples_of("r", SamplingParams(n=2))] == [None, None]


def test_the_engine_fans_out_by_the_same_rule() -> None:
    params = SamplingParams(n=2, seed=3)
    parent = ParentRequest.fan_out(
        "req", None, [1, 2], params, tokenizer=None, max_total_tokens=64, eos_token_ids=()
    )
    engine_side = [(c.request_id, c.sampling_params) for c in parent.children]
    assert engine_side == samples_of("req", params)
    assert all(c.generator is not None for c in parent.children)  # seeded: its own RNG
