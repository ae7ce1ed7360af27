"""SamplingParams validation: defaults, every invalid value of every field, valid edge values."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.common.sampling_params import SamplingParams


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert (p.stop_token_ids, p.stop, p.ignore_eos) == ((), (), False)
    assert (p.logprobs, p.skip_special_tokens) == (None, True)
    assert not p.is_greedy
    assert not (p.uses_top_k or p.uses_top_p or p.uses_min_p or p.has_penalties)


INVALID: list[tuple[str, Any, str]] = [
    ("n", 0, ">= 1"),
    ("n", -3, ">= 1"),
    ("n", 1.0, "int"),
    ("n", True, "int"),
    ("temperature", -1.0, ">= 0"),
    ("temperature", -1e-9, ">= 0"),
    ("temperature", "0.5", "number"),
    ("temperature", float("nan"), "finite"),
    ("temperature", float("inf"), "finite"),
    ("temperature", None, "number"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", -0.5, "(0, 1]"),
    ("top_p", 1.0001, "(0, 1]"),
    ("top_p", float("nan"), "finite"),
    ("top_k", -2, "-1, 0"),
    ("top_k", 5.0, "int"),
    ("top_k", "5", "int"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("repetition_penalty", float("inf"), "finite"),
    ("presence_penalty", -2.01, "[-2, 2]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"),
    ("frequency_penalty", 2.0001, "[-2, 2]"),
    ("seed", -1, "seed must be in"),
    ("seed", 2**64, "seed must be in"),
    ("seed", 1.5, "int"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -5, ">= 1"),
    ("max_tokens", 3.0, "int"),
    ("min_tokens", -1, ">= 0"),
    ("min_tokens", 17, "<= max_tokens"),
    ("stop_token_ids", [1, -2], "non-negative"),
    ("stop_token_ids", [1, 2.0], "int"),
    ("stop_token_ids", [True], "int"),
    ("stop_token_ids", 5, "list or tuple"),
    ("stop", [""], "non-empty"),
    ("stop", ["ok", 3], "non-empty strings"),
    ("stop", 7, "list or tuple"),
    ("ignore_eos", 1, "bool"),
    ("logprobs", -1, "[0, 20]"),
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", 2.0, "int"),
    ("skip_special_tokens", "yes", "bool"),
    # int64: the sampler builds int64 tensors of these; more would overflow inside a step.
    ("n", 2**63, "64-bit"),
    ("top_k", 2**63, "64-bit"),
    ("top_k", 2**64, "64-bit"),
    ("max_tokens", 2**63, "64-bit"),
    ("min_tokens", 2**64, "64-bit"),
    ("stop_token_ids", [2**63], "64-bit"),
    ("stop_token_ids", [5, 2**64], "64-bit"),
    ("stop_token_ids", [-1], "non-negative"),
    ("stop_token_ids", [-(2**64)], "64-bit"),
    ("logprobs", 2**64, "64-bit"),
    ("logit_bias", {-1: 1.0}, ">= 0"),
    ("logit_bias", {5: 100.5}, "[-100, 100]"),
    ("logit_bias", {5: -101}, "[-100, 100]"),
    ("logit_bias", {5: float("inf")}, "finite"),
    ("logit_bias", {5: "1"}, "number"),
    ("structured_outputs", {"json": {}}, "StructuredOutputs or None"),
    ("prompt_logprobs", 21, "[0, 20]"),
    ("prompt_logprobs", -1, "[0, 20]"),
    ("prompt_logprobs", 1.5, "int"),
    ("logit_bias", {"5": 1.0}, "int"),
    ("logit_bias", {True: 1.0}, "int"),
    ("logit_bias", {2**63: 1.0}, "64-bit"),
    ("logit_bias", [(1, 1.0), (1, 2.0)], "twice"),
    ("logit_bias", [(1, 1.0, 3)], "map token ids"),
    ("logit_bias", "1:1", "list or tuple"),
    ("logit_bias", {i: 1.0 for i in range(1025)}, "at most 1024"),
    ("allowed_token_ids", [], "at least one token"),
    ("allowed_token_ids", [3, -1], "non-negative"),
    ("allowed_token_ids", [1.5], "int"),
    ("allowed_token_ids", [True], "int"),
    ("allowed_token_ids", [2**63], "64-bit"),
    ("allowed_token_ids", 5, "list or tuple"),
]


@pytest.mark.parametrize(("field", "value", "message"), INVALID)
def test_invalid_value_raises_naming_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    text = str(err.value)
    # The field comes first: the router reports the message's first word as the bad `param`.
    assert text.split()[0] == field
    assert message in text


def test_every_field_has_an_invalid_case() -> None:
    from dataclasses import fields

    assert {f.name for f in fields(SamplingParams)} == {f for f, _, _ in INVALID}


VALID_EDGES: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 100.0},
    {"top_p": 1e-9},
    {"top_p": 1},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10**9},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"repetition_penalty": 1e-6},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"seed": 0},
    {"seed": 2**64 - 1},
    {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 1, "min_tokens": 1},
    {"stop_token_ids": [0, 5], "stop": ["\n\n", "###"]},
    {"stop": "END"},
    {"logprobs": 0},
    {"logprobs": 20},
    {"ignore_eos": True, "skip_special_tokens": False},
    {"stop_token_ids": [2**63 - 1], "max_tokens": 2**63 - 1, "min_tokens": 2**63 - 1},
    {"top_k": 2**63 - 1},
    # Accepted as vLLM does; the sampler clamps them into what its fp32 arithmetic can take.
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300},
    {"temperature": 1e300},
    {"logit_bias": {0: -100, 2**63 - 1: 100}},
    {"logit_bias": [(7, 0.5)]},
    {"logit_bias": {i: 1.0 for i in range(1024)}},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES)
def test_valid_edge_values_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_out_of_range_values_are_kept_as_given() -> None:
    """Clamping is the sampler's business: params keep what the client asked for."""
    p = SamplingParams(temperature=1e300, repetition_penalty=1e-300)
    assert (p.temperature, p.repetition_penalty) == (1e300, 1e-300)


def test_normalisation_and_immutability() -> None:
    p = SamplingParams(temperature=0, stop_token_ids=[3, 4], stop="END")
    assert isinstance(p.temperature, float)
    assert p.stop_token_ids == (3, 4)
    assert p.stop == ("END",)
    assert p.is_greedy
    assert hash(p) == hash(SamplingParams(temperature=0.0, stop_token_ids=(3, 4), stop=["END"]))
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


def test_allowed_token_ids_are_stored_sorted_once() -> None:
    assert SamplingParams(allowed_token_ids=[9, 3, 9, 4]).allowed_token_ids == (3, 4, 9)
    assert SamplingParams().allowed_token_ids is None
    assert SamplingParams(allowed_token_ids=(7,)) == SamplingParams(allowed_token_ids=[7, 7])


def test_logit_bias_is_stored_as_sorted_pairs() -> None:
    """A dict or pairs, any order: one immutable, hashable form (and what asdict round-trips)."""
    from dataclasses import asdict

    p = SamplingParams(logit_bias={9: 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (9, 1.0))
    assert p == SamplingParams(logit_bias=[(9, 1.0), (3, -2.5)])
    assert hash(p) == hash(SamplingParams(logit_bias=((3, -2.5), (9, 1))))
    assert SamplingParams(**asdict(p)) == p
    assert SamplingParams().logit_bias == ()
    assert p.for_sample(2).logit_bias == p.logit_bias  # every sample of n gets the bias


def test_greedy_constructor_and_flags() -> None:
    g = SamplingParams.greedy(max_tokens=4, seed=1)
    assert g.is_greedy and g.max_tokens == 4 and g.seed == 1
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(top_k=5).uses_top_k and not SamplingParams(top_k=-1).uses_top_k
    assert SamplingParams(top_p=0.5).uses_top_p
    assert SamplingParams(min_p=0.1).uses_min_p
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


@given(
    temperature=st.floats(0.0, 10.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    min_p=st.floats(0.0, 1.0),
    presence=st.floats(-2.0, 2.0),
    max_tokens=st.integers(1, 4096),
    data=st.data(),
)
def test_any_in_range_combination_is_accepted(
    temperature: float,
    top_p: float,
    min_p: float,
    presence: float,
    max_tokens: int,
    data: st.DataObject,
) -> None:
    min_tokens = data.draw(st.integers(0, max_tokens))
    p = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
    )
    assert p.min_tokens <= (p.max_tokens or 0)
