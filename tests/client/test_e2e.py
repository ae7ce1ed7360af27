"""The SDK against the real server (`kvrelay serve` on the default model, CPU).

Generations stay short (max_tokens <= 16): the model runs at tens of tokens per second here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvrelay.client import (
    AsyncClient,
    ChatMessage,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
)

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture
def client(kvrelay_server: Any) -> Any:
    with Client(kvrelay_server.grpc_target, timeout=120.0) as c:
        yield c


def test_sync_whole_and_streamed_agree_under_greedy(client: Client) -> None:
    whole = client.generate(PROMPT, **GREEDY)
    [choice] = whole.choices
    assert choice.text and len(choice.token_ids) <= 8
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens == len(choice.token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.generate(PROMPT, stream=True, **GREEDY))
    assert len(chunks) >= 2  # streamed means more than one response
    assert all(c.request_id == chunks[0].request_id for c in chunks)
    text = "".join(d.text for c in chunks for d in c.choices)
    ids = tuple(t for c in chunks for d in c.choices for t in d.token_ids)
    assert text == choice.text and ids == choice.token_ids
    # The usage comes last (alone, or with the final deltas); the finish reason with or
    # before it.
    finishes = [d.finish_reason for c in chunks for d in c.choices if d.finish_reason]
    assert finishes == [choice.finish_reason]
    last = chunks[-1].usage
    assert last is not None  # cached_tokens may differ: the second call can hit the cache
    assert (last.prompt_tokens, last.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_and_request_id_echo(client: Client) -> None:
    result = client.generate([1, 504, 3458], request_id="sdk-e2e-1", **GREEDY)
    assert result.request_id == "sdk-e2e-1" and result.choices[0].token_ids


def test_n_samples(client: Client) -> None:
    result = client.generate(PROMPT, n=2, temperature=0.8, seed=1, max_tokens=6)
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.finish_reason is not None and c.token_ids for c in result.choices)
    assert result.usage is not None
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in result.choices)


def test_async_whole_and_streamed_agree_under_greedy(kvrelay_server: Any) -> None:
    async def run() -> tuple[str, str]:
        async with AsyncClient(kvrelay_server.grpc_target, timeout=120.0) as client:
            whole = await client.generate(PROMPT, **GREEDY)
            stream = await client.generate(PROMPT, stream=True, **GREEDY)
            streamed = "".join([d.text async for c in stream for d in c.choices])
            return whole.text, streamed

    whole, streamed = asyncio.run(run())
    assert whole and whole == streamed


def test_chat_sync_and_async(client: Client, kvrelay_server: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat(messages, **GREEDY)
    assert reply.text and reply.usage is not None and reply.usage.prompt_tokens > 5

    async def run() -> str:
        async with AsyncClient(kvrelay_server.grpc_target, timeout=120.0) as c:
            stream = await c.chat(
                [ChatMessage("user", "What is the capital of France?")], stream=True, **GREEDY
            )
            return "".join([d.text async for chunk in stream for d in chunk.choices])

    assert asyncio.run(run()) == reply.text


def test_models_and_health(client: Client, kvrelay_server: Any) -> None:
    models = client.models()
    assert kvrelay_server.model in [m.id for m in models]
    assert all(m.max_model_len > 0 for m in models)
    assert client.health()

    async def run() -> tuple[bool, list[str]]:
        async with AsyncClient(kvrelay_server.grpc_target) as c:
            return await c.health(), [m.id for m in await c.models()]

    healthy, ids = asyncio.run(run())
    assert healthy and kvrelay_server.model in ids


def test_explicit_model_and_unknown_model(client: Client, kvrelay_server: Any) -> None:
    assert client.generate(PROMPT, model=kvrelay_server.model, max_tokens=2).choices
    # generation.proto: an unknown model is bad input, INVALID_ARGUMENT naming the field.
    with pytest.raises(InvalidArgumentError, match="no-such-model"):
        client.generate(PROMPT, model="no-such-model", max_tokens=2)


def test_logit_bias_over_grpc(client: Client) -> None:
    """The same bias as the HTTP API: +100 makes greedy repeat the token; an id past the
    vocabulary is refused naming the field (sampling.logit_bias)."""
    result = client.generate(PROMPT, temperature=0.0, max_tokens=4, logit_bias={504: 100.0})
    assert result.choices[0].token_ids == (504, 504, 504, 504)
    with pytest.raises(InvalidArgumentError) as info:
        client.generate(PROMPT, max_tokens=2, logit_bias={10**9: 1.0})
    assert "sampling.logit_bias" in info.value.details and "[0, " in info.value.details


@pytest.mark.parametrize(
    ("name", "value"),
    [("temperature", -1.0), ("top_p", 1.5), ("max_tokens", 0), ("logit_bias", {3: 500.0})],
)
def test_bad_params_name_the_field(client: Client, name: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate(PROMPT, **{name: value})
    assert name in info.value.details


def test_tiny_timeout_is_deadline_exceeded(client: Client) -> None:
    with pytest.raises(DeadlineExceededError):
        client.generate(PROMPT, max_tokens=16, ignore_eos=True, timeout=0.001)

    async def run() -> None:
        async with AsyncClient(client.options.target) as c:
            await c.generate(PROMPT, max_tokens=16, ignore_eos=True, timeout=0.001)

    with pytest.raises(DeadlineExceededError):
        asyncio.run(run())
