"""vLLM's add_special_tokens through the prompt encoder, on a tokenizer that adds a BOS (the
real SmolLM2 tokenizer adds none, so its post-processor is given one here): a completion's
text gets it by default and not when asked; a chat prompt (its template writes its own special
tokens) gets it only when asked, in front of exactly what the template rendered."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvrelay.router.prompt_encoder import PromptEncoder
from kvrelay.router.prompts import chat_messages

BOS = "<|im_start|>"


@pytest.fixture(scope="module")
def bos_tokenizer(default_model_dir: Path) -> Any:
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    plain = AutoTokenizer.from_pretrained(str(default_model_dir))
    backend = plain.backend_tokenizer
    bos_id = plain.convert_tokens_to_ids(BOS)
    backend.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS)
    tokenizer.chat_template = plain.chat_template
    return tokenizer


def encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return asyncio.run(PromptEncoder(tokenizer, 8192).encode(text, "prompt", special))


def render(tokenizer: Any, special: bool) -> tuple[str, list[int]]:
    messages = chat_messages([{"role": "user", "content": "Hi there"}], tools=True)
    encoder = PromptEncoder(tokenizer, 8192)
    return asyncio.run(encoder.render_chat(messages, True, None, None, special))


def test_a_text_prompt_gets_the_bos_unless_told_not_to(bos_tokenizer: Any) -> None:
    bos = bos_tokenizer.convert_tokens_to_ids(BOS)
    with_bos = encode(bos_tokenizer, "Hello world", True)
    without = encode(bos_tokenizer, "Hello world", False)
    assert with_bos == [bos, *without] and without and bos not in without


def test_a_chat_prompt_gets_the_bos_only_when_asked(bos_tokenizer: Any) -> None:
    bos = bos_tokenizer.convert_tokens_to_ids(BOS)
    text, plain = render(bos_tokenizer, False)
    same_text, added = render(bos_tokenizer, True)
    assert text == same_text and plain == bos_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert added == [bos, *plain]
