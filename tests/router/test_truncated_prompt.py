"""vLLM's truncate_prompt_tokens (router/prompts.py): the last k tokens, -1 for the context
length's worth, and a 400 naming the field for values that mean nothing."""

from __future__ import annotations

import pytest

from kvrelay.router.prompts import truncated_prompt
from kvrelay.router.request_errors import InvalidRequestError

IDS = list(range(100, 120))  # 20 tokens


def test_keeps_the_last_k_tokens() -> None:
    assert truncated_prompt(IDS, 5, 64) == IDS[-5:]
    assert truncated_prompt(IDS, 1, 64) == [119]
    assert truncated_prompt(IDS, 20, 64) == IDS
    assert truncated_prompt(IDS, 64, 64) == IDS  # longer than the prompt: all of it


def test_none_keeps_the_prompt_whole_and_minus_one_means_the_context() -> None:
    assert truncated_prompt(IDS, None, 8) == IDS  # not asked: the router refuses it later
    assert truncated_prompt(IDS, -1, 8) == IDS[-8:]
    assert truncated_prompt(IDS, -1, 64) == IDS


@pytest.mark.parametrize("keep", [0, -2, -100])
def test_values_below_one_but_minus_one_are_refused(keep: int) -> None:
    with pytest.raises(InvalidRequestError, match="-1 or at least 1") as info:
        truncated_prompt(IDS, keep, 64)
    assert info.value.param == "truncate_prompt_tokens"


def test_more_than_the_context_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="context length of 64") as info:
        truncated_prompt(IDS, 65, 64)
    assert info.value.param == "truncate_prompt_tokens"
