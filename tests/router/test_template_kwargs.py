"""chat_template_kwargs and messages.N.name: checked by the router, seen by the chat template
(the real SmolLM2 tokenizer, with a template that reads a variable and names)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvrelay.router.prompt_encoder import PromptEncoder
from kvrelay.router.prompts import MAX_NAME_CHARS, chat_messages
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.template_kwargs import MAX_KWARGS_CHARS, RESERVED, template_kwargs

# Reads a variable of its own (like Qwen3's enable_thinking) and each message's name.
TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}"
    "{% if m.name is defined %} ({{ m.name }}){% endif %}: {{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def render(tokenizer: Any, messages: list[dict[str, Any]], variables: Any = None) -> str:
    encoder = PromptEncoder(tokenizer, 8192)
    try:
        checked = chat_messages(messages, tools=True)
        text, ids = asyncio.run(
            encoder.render_chat(checked, True, None, template_kwargs(variables))
        )
    finally:
        encoder.close()
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    return text


def test_the_template_sees_the_variables(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, messages, {"enable_thinking": False}).startswith("/no_think\n")
    assert "/no_think" not in render(tokenizer, messages, {"enable_thinking": True})
    assert "/no_think" not in render(tokenizer, messages)


def test_the_template_sees_each_name(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ada"},
    ]
    text = render(tokenizer, messages)
    assert "<|im_start|>user (ada): Hi" in text
    assert "<|im_start|>system: Be brief." in text  # no name, nothing added


def test_the_default_template_ignores_names(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(default_model_dir))
    named = render(plain, [{"role": "user", "content": "Hi", "name": "ada"}])
    assert named == render(plain, [{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        ([1, 2], "chat_template_kwargs", "must be an object"),
        ("enable_thinking", "chat_template_kwargs", "must be an object"),
        ({"not a name": 1}, "chat_template_kwargs", "variable names"),
        ({"tokenize": True}, "chat_template_kwargs.tokenize", "use the request's own field"),
        ({"chat_template": "{{ 1 }}"}, "chat_template_kwargs.chat_template", "parameter"),
        ({"messages": []}, "chat_template_kwargs.messages", "parameter"),
        ({"x": "a" * MAX_KWARGS_CHARS}, "chat_template_kwargs", "longer than"),
    ],
)
def test_bad_variables_are_refused_by_name(raw: Any, param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        template_kwargs(raw)
    assert info.value.param == param


def test_every_reserved_key_is_refused() -> None:
    for key in RESERVED:
        with pytest.raises(InvalidRequestError):
            template_kwargs({key: 1})
    assert template_kwargs(None) == {} and template_kwargs({"a_b": [1, {"c": None}]})


@pytest.mark.parametrize("name", [1, "", "x" * (MAX_NAME_CHARS + 1), "\ud800"])
def test_bad_names_are_refused_by_name(name: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat_messages([{"role": "user", "content": "Hi", "name": name}])
    assert info.value.param == "messages.0.name"


def test_a_name_travels_with_its_message() -> None:
    [checked] = chat_messages([{"role": "developer", "content": "Hi", "name": "ops"}])
    assert checked == {"role": "system", "content": "Hi", "name": "ops"}
