"""vLLM's allowed_token_ids against the session's P/D server: over HTTP with the real `openai`
client (both endpoints, prompts that prefill on the prefill worker and ones that run whole on
the decode worker) and over gRPC with the SDK. Only the allowed ids come out; a request beside
one that limits its tokens gives what it gives alone; bad ids are refused naming the field."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvrelay.client import Client, InvalidArgumentError
from tests.api.test_return_token_ids import CHAT, LONG, SHORT, extra
from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
ALLOWED = [28, 29, 253, 30, 504]  # ",", "-", " a", ".", "The" in SmolLM2's vocabulary


def complete(client: openai.OpenAI, prompt: str, **extra_body: Any) -> Any:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra_body},
    )  # fmt: skip


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode-only", "prefilled"])
def test_a_completion_keeps_to_its_allowed_ids(client: openai.OpenAI, prompt: str) -> None:
    kept = extra(complete(client, prompt, allowed_token_ids=ALLOWED).choices[0], "token_ids")
    assert len(kept) == 8 and set(kept) <= set(ALLOWED)
    hot = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=2.0, seed=7,
        extra_body={"return_token_ids": True, "ignore_eos": True, "allowed_token_ids": ALLOWED},
    )  # fmt: skip
    assert set(extra(hot.choices[0], "token_ids")) <= set(ALLOWED)


def test_the_limit_is_its_requests_alone(client: openai.OpenAI) -> None:
    alone = extra(complete(client, LONG).choices[0], "token_ids")
    both = client.completions.create(
        model=MODEL, prompt=[LONG, LONG], max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "allowed_token_ids": [504]},
    )  # fmt: skip
    assert [extra(c, "token_ids") for c in both.choices] == [[504] * 8] * 2
    assert extra(complete(client, LONG).choices[0], "token_ids") == alone


def test_chat_keeps_to_its_allowed_ids(
    kvrelay_server: ServerProcess, client: openai.OpenAI
) -> None:
    reply = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "allowed_token_ids": ALLOWED},
    )  # fmt: skip
    ids = extra(reply.choices[0], "token_ids")
    assert len(ids) == 6 and set(ids) <= set(ALLOWED)


@pytest.mark.parametrize("bad", [[], [10**6], [-1], [1.5]])
def test_bad_ids_are_a_400_naming_the_field(client: openai.OpenAI, bad: list[Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, SHORT, allowed_token_ids=bad)
    assert info.value.body is not None  # the field, or its element: allowed_token_ids.0
    assert info.value.body["param"].startswith("allowed_token_ids")


def test_the_sdk_carries_allowed_ids_over_grpc(kvrelay_server: ServerProcess) -> None:
    with Client(kvrelay_server.grpc_target, timeout=120.0) as sdk:
        result = sdk.generate(
            LONG, temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=ALLOWED
        )
        assert set(result.choices[0].token_ids) <= set(ALLOWED)
        with pytest.raises(InvalidArgumentError) as info:
            sdk.generate(SHORT, max_tokens=2, allowed_token_ids=[10**6])
        assert "sampling.allowed_token_ids" in info.value.details
        with pytest.raises(InvalidArgumentError, match="at least one token"):
            sdk.generate(SHORT, max_tokens=2, allowed_token_ids=[])
