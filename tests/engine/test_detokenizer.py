"""Incremental detokenization: the streamed pieces add up to the whole decode; stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrelay.common.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from kvrelay.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you today?",
        "naïve café — déjà vu 😀🎉 中文字符",
        "def f(x):\n    return x  # two spaces",
    ],
)
def test_pieces_join_to_the_full_decode(tokenizer: Any, text: str) -> None:
    prompt = tokenizer("Say:")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    pieces = [detok.add(t)[0] for t in ids]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces), "a half character leaked"


def test_stop_string_across_tokens_cuts_before_it(tokenizer: Any) -> None:
    ids = tokenizer("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma", "zeta"])
    matched = None
    for token in ids:
        _, matched = detok.add(token)
        if matched:
            break
    assert matched == "gamma"
    assert detok.text == "alpha beta "


def test_special_tokens_are_skipped_unless_asked(tokenizer: Any) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hidden = IncrementalDetokenizer(tokenizer)
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    for token in [*tokenizer("Hi", add_special_tokens=False)["input_ids"], end]:
        hidden.add(token)
        shown.add(token)
    assert hidden.text == "Hi"
    assert shown.text == "Hi<|im_end|>"
