"""One sample's assembly in the router: positions line streams up, stop strings end it (text
cut, worker to be aborted), logprobs stay one per token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrelay.common.messages import SampleDelta
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.models.tokenizer import load_tokenizer
from kvrelay.router.sample_state import SampleState


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_overlapping_deltas_add_only_new_tokens(tokenizer: Any) -> None:
    tokens = ids(tokenizer, " one two three four")
    state = SampleState(0, tokenizer, SamplingParams(), ids(tokenizer, "Count:"))
    first = state.feed(SampleDelta(0, 0, tokens[:1]))
    # A recompute repeats token 0, then goes on.
    second = state.feed(SampleDelta(0, 0, tokens[:3]))
    third = state.feed(SampleDelta(0, 3, tokens[3:], finish_reason="length"))
    assert first is not None and second is not None and third is not None
    assert second.token_ids == tokens[1:3]
    assert first.text + second.text + third.text == " one two three four"
    assert state.token_ids == tokens and third.finish_reason == "length"
    assert state.feed(SampleDelta(0, 4, [5])) is None  # finished: nothing more
    with pytest.raises(ValueError, match="gap"):
        SampleState(0, tokenizer, SamplingParams(), []).feed(SampleDelta(0, 2, [5]))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_and_finishes(tokenizer: Any, include: bool) -> None:
    tokens = ids(tokenizer, " 5, 6, 7, 8, 9")
    params = SamplingParams(stop=[" 7"])
    state = SampleState(0, tokenizer, params, ids(tokenizer, "1, 2, 3, 4,"), include)
    news = state.feed(SampleDelta(0, 0, tokens))
    assert news is not None and news.finish_reason == "stop" and news.stop_reason == " 7"
    assert news.text == (" 5, 6, 7" if include else " 5, 6,")
    assert len(state.token_ids) < len(tokens)  # tokens after the match are dropped


def test_logprobs_follow_their_tokens(tokenizer: Any) -> None:
    tokens = ids(tokenizer, " a b")
    entries = [{tokens[0]: -0.5, 7: -1.5}, {tokens[1]: -2.5, 9: -0.1}]
    state = SampleState(0, tokenizer, SamplingParams(logprobs=1), [])
    news = state.feed(SampleDelta(0, 0, tokens, entries))
    assert news is not None and news.logprobs is not None
    assert [(e.token_id, e.logprob) for e in news.logprobs] == [
        (tokens[0], -0.5),
        (tokens[1], -2.5),
    ]
    assert news.logprobs[1].top[0] == (9, -0.1)  # best first, the sampled one after


@pytest.mark.parametrize("include", [False, True])
def test_streamed_token_by_token_never_shows_part_of_a_stop_string(
    tokenizer: Any, include: bool
) -> None:
    tokens = ids(tokenizer, " 5, 6, 7, 8, 9")
    state = SampleState(0, tokenizer, SamplingParams(stop=[" 7"]), [], include)
    pieces = []
    for position, token in enumerate(tokens):
        news = state.feed(SampleDelta(0, position, [token]))
        if news is not None:
            pieces.append(news.text)
        if state.finished:
            break
    assert "".join(pieces) == (" 5, 6, 7" if include else " 5, 6,")
