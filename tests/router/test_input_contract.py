"""The one validator both APIs share (router/prompts.py), the prompt encoder that keeps
tokenizing off the event loop (router/prompt_encoder.py), and the router's own request checks
(n, n x max_tokens, the context length), each error naming the field as the client spelled it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvrelay.common.messages import Role, WorkerInfo
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.metrics import RouterMetrics
from kvrelay.router.prompt_encoder import PromptEncoder
from kvrelay.router.prompts import chat_messages, check_text, prompt_token_ids, sampling_params
from kvrelay.router.request_errors import InvalidRequestError
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.types import GenerateRequest, new_request_id
from kvrelay.router.workers import WorkerRegistry, WorkerState


def refused(fn: Any, *args: Any, **kwargs: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args, **kwargs)
    return info.value


# -- sampling fields ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"n": 0}, "n"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 1e300}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["ok", "bad \ud800"]}, "stop"),
    ],
)
def test_a_bad_sampling_field_is_named(fields: dict[str, Any], param: str) -> None:
    assert refused(sampling_params, fields).param == param


def test_errors_use_the_wire_name_of_the_field() -> None:
    chat = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
    error = refused(sampling_params, {"logprobs": 21}, chat)
    assert error.param == "top_logprobs"
    assert error.message.startswith("top_logprobs must be in [0, 20]")
    error = refused(sampling_params, {"seed": -1}, {"seed": "sampling.seed"})
    assert error.param == "sampling.seed"


def test_none_keeps_the_default() -> None:
    assert sampling_params({"n": None, "temperature": None}) == SamplingParams()


# -- text, chat messages, token ids ---------------------------------------------------------------


def test_a_lone_surrogate_is_refused_with_its_position() -> None:
    error = refused(check_text, "abc \ud800 def", "prompt")
    assert error.param == "prompt"
    assert "character 4" in error.message
    assert check_text("naïve ✓", "prompt") == "naïve ✓"


@pytest.mark.parametrize("role", ["tool", "bogus", "", "SYSTEM", None, 3])
def test_unknown_chat_roles_are_refused(role: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    assert refused(chat_messages, messages).param == "messages.1.role"


def test_chat_messages_are_normalised() -> None:
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        },
        {"role": "user", "content": None},
    ]
    assert chat_messages(messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": 5}, "messages.0.content"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages.0.content.0"),
        ({"role": "user", "content": "bad \udfff"}, "messages.0.content"),
    ],
)
def test_bad_chat_content_is_named(message: dict[str, Any], param: str) -> None:
    assert refused(chat_messages, [message]).param == param


def test_no_messages_is_refused() -> None:
    assert refused(chat_messages, []).param == "messages"


def test_token_ids_must_be_ints() -> None:
    assert refused(prompt_token_ids, [], "prompt_token_ids").param == "prompt_token_ids"
    assert refused(prompt_token_ids, [1, True]).param == "prompt"
    assert prompt_token_ids([1, 2]) == [1, 2]


# -- the encoder ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from kvrelay.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


class _ThreadRecorder:
    """A tokenizer wrapper that notes the thread each call ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: list[threading.Thread] = []
        self.chat_template = tokenizer.chat_template

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab())


async def test_tokenizing_and_templating_run_off_the_event_loop(tokenizer: Any) -> None:
    recorder = _ThreadRecorder(tokenizer)
    encoder = PromptEncoder(recorder, max_model_len=8192)
    try:
        ids = await encoder.encode("The capital of France is")
        assert ids == list(tokenizer("The capital of France is")["input_ids"])
        text, chat_ids = await encoder.render_chat([{"role": "user", "content": "hi"}])
        assert "hi" in text and chat_ids
    finally:
        encoder.close()
    assert len(recorder.threads) == 3  # encode, template, encode of the rendered text
    assert all(t is not threading.main_thread() for t in recorder.threads)


async def test_a_prompt_far_over_the_context_is_refused_without_tokenizing(
    tokenizer: Any,
) -> None:
    recorder = _ThreadRecorder(tokenizer)
    encoder = PromptEncoder(recorder, max_model_len=64)
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as info:
            await encoder.encode("a " * 5_000_000)
        assert time.monotonic() - started < 1.0
        assert info.value.param == "prompt"
        assert "shorten" in info.value.message
        with pytest.raises(InvalidRequestError) as info:
            await encoder.render_chat([{"role": "user", "content": "b" * 10_000_000}])
        assert info.value.param == "messages.0.content"
        with pytest.raises(InvalidRequestError):
            await encoder.encode("")
    finally:
        encoder.close()
    assert recorder.threads == []  # nothing reached the tokenizer


async def test_the_loop_keeps_ticking_while_a_long_prompt_is_tokenized(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=1_000_000)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        started = time.monotonic()
        ids = await encoder.encode("hello world, " * 100_000)
        took = time.monotonic() - started
    finally:
        tick.cancel()
        encoder.close()
    assert len(ids) > 100_000
    # The loop ran throughout: its longest pause is a small part of the tokenizing time.
    assert len(gaps) > 5
    assert max(gaps) < max(0.5, took / 2)


# -- the router's checks --------------------------------------------------------------------------


def router_over(num_blocks: int, max_model_len: int = 2048, max_n: int = 8) -> Router:
    registry = WorkerRegistry()
    info = WorkerInfo(Role.DECODE, "d0", 1, 16, ("m",), num_blocks, max_model_len)
    registry.workers["d0"] = WorkerState(None, info)
    card = ModelCard("m", max_model_len, 0)
    return Router.create(registry, None, card, RouterConfig(max_n=max_n), RouterMetrics())


def request(
    n: int = 1, max_tokens: int | None = 16, prompt: int = 4, names: dict[str, str] | None = None
) -> GenerateRequest:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return GenerateRequest(new_request_id(), list(range(prompt)), params, field_names=names or {})


def test_n_is_bounded() -> None:
    router = router_over(num_blocks=1000, max_n=8)
    router.check_request(request(n=8))
    assert refused(router.check_request, request(n=9)).param == "n"
    assert (
        refused(router.check_request, request(n=9, names={"n": "sampling.n"})).param == "sampling.n"
    )


def test_n_samples_must_fit_the_decode_pool() -> None:
    """Each sample counts its prompt and max_tokens (issue 41: admission by cost)."""
    router = router_over(num_blocks=10)  # 160 tokens of KV
    router.check_request(request(n=4, max_tokens=36))  # 4 x (4 + 36) = 160
    error = refused(router.check_request, request(n=4, max_tokens=37))
    assert error.param == "n"
    assert "160 tokens" in error.message
    # No max_tokens: each sample may reach the context length (2048): refused, naming n...
    error = refused(router.check_request, request(n=2, max_tokens=None))
    assert error.param == "n" and "no max_tokens" in error.message
    router.check_request(request(n=1, max_tokens=None))  # ...but one sample alone may run


def test_a_context_overflow_names_the_field_the_client_sent() -> None:
    router = router_over(num_blocks=1000, max_model_len=64)
    chat = {"max_tokens": "max_completion_tokens", "prompt": "messages"}
    error = refused(router.check_request, request(max_tokens=61, names=chat))
    assert error.param == "max_completion_tokens"
    error = refused(router.check_request, request(prompt=64, names=chat))
    assert error.param == "messages"


def test_server_made_ids_are_unique() -> None:
    assert len({new_request_id() for _ in range(1000)}) == 1000
