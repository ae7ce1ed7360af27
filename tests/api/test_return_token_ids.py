"""vLLM's `return_token_ids` with the real `openai` client against the session's P/D server
on loopback: a completion choice carries its prompt's ids (`prompt_token_ids`) and the ids it
generated (`token_ids`); a chat response carries the prompt's ids once, beside its choices.
Streamed, the prompt's ids come with a choice's (completions) or the response's (chat) first
chunk and each chunk's `token_ids` are the ids it adds. Without the field nothing changes.
And `return_tokens_as_token_ids`: logprobs name their tokens "token_id:N"."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from typing import Any

import openai
import pytest

from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHORT = "The capital of France is"  # decode-only on the P/D server
LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
CHAT = [{"role": "user", "content": "Name three colours."}]
IDS = {"return_token_ids": True}


def extra(obj: Any, name: str) -> Any:
    """A vLLM field the openai client keeps as an extra on its response objects."""
    return (obj.model_extra or {}).get(name)


def tokenized(server: ServerProcess, body: dict[str, Any]) -> list[int]:
    request = urllib.request.Request(
        f"{server.http_url}/tokenize",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        tokens: list[int] = json.loads(response.read())["tokens"]
    return tokens


def complete(client: openai.OpenAI, prompt: Any, **kw: Any) -> Any:
    return client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0, **kw
    )


def test_completion_choices_carry_their_prompt_and_generated_ids(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    prompts = [tokenizer(SHORT)["input_ids"], tokenizer(LONG)["input_ids"][1:]]
    reply = complete(client, prompts, n=2, extra_body=IDS)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = complete(client, [SHORT, LONG], extra_body=IDS)  # encoded by the server
    assert [extra(c, "prompt_token_ids") for c in texts.choices] == [
        prompts[0], tokenizer(LONG)["input_ids"]
    ]  # fmt: skip
    generated = 0
    for choice in reply.choices:
        assert extra(choice, "prompt_token_ids") == prompts[choice.index // 2]
        ids = extra(choice, "token_ids")
        assert ids and all(isinstance(i, int) for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice.text
        generated += len(ids)
    assert reply.usage is not None and generated == reply.usage.completion_tokens


def test_streamed_completion_ids_add_up_to_the_whole_ones(client: openai.OpenAI) -> None:
    whole = complete(client, [SHORT, LONG], extra_body=IDS)
    streamed: dict[int, list[int]] = defaultdict(list)
    prompt_ids: dict[int, list[list[int]]] = defaultdict(list)
    for chunk in complete(client, [SHORT, LONG], stream=True, extra_body=IDS):
        for choice in chunk.choices:
            streamed[choice.index] += extra(choice, "token_ids")
            if extra(choice, "prompt_token_ids") is not None:
                prompt_ids[choice.index].append(extra(choice, "prompt_token_ids"))
    for choice in whole.choices:
        assert streamed[choice.index] == extra(choice, "token_ids")
        assert prompt_ids[choice.index] == [extra(choice, "prompt_token_ids")]  # once, first


def test_echo_keeps_token_ids_to_the_generated_ones(client: openai.OpenAI) -> None:
    echoed = complete(client, SHORT, echo=True, extra_body=IDS).choices[0]
    plain = complete(client, SHORT, extra_body=IDS).choices[0]
    assert echoed.text.startswith(SHORT)
    assert extra(echoed, "token_ids") == extra(plain, "token_ids")
    assert extra(echoed, "prompt_token_ids") == extra(plain, "prompt_token_ids")
    prompt_only = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=SHORT, max_tokens=0, echo=True, extra_body=IDS
    ).choices[0]
    assert prompt_only.text == SHORT and extra(prompt_only, "token_ids") == []


def test_chat_carries_the_prompt_ids_once_and_each_choice_its_own(
    kvrelay_server: ServerProcess, client: openai.OpenAI, tokenizer: Any
) -> None:
    expected_prompt = tokenized(kvrelay_server, {"messages": CHAT})
    reply = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=8, temperature=0, n=2,
        extra_body=IDS,
    )  # fmt: skip
    assert extra(reply, "prompt_token_ids") == expected_prompt
    for choice in reply.choices:
        ids = extra(choice, "token_ids")
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
        assert extra(choice, "prompt_token_ids") is None
    chunks = list(
        client.chat.completions.create(
            model=kvrelay_server.model, messages=CHAT, max_tokens=8, temperature=0,
            stream=True, extra_body=IDS,
        )
    )  # fmt: skip
    with_prompt = [i for i, c in enumerate(chunks) if extra(c, "prompt_token_ids") is not None]
    assert with_prompt == [0] and extra(chunks[0], "prompt_token_ids") == expected_prompt
    streamed = [t for c in chunks for choice in c.choices for t in extra(choice, "token_ids")]
    assert streamed == extra(reply.choices[0], "token_ids")


def test_without_the_field_no_ids_are_added(
    kvrelay_server: ServerProcess, client: openai.OpenAI
) -> None:
    reply = complete(client, SHORT)
    assert extra(reply.choices[0], "token_ids") is None
    assert extra(reply.choices[0], "prompt_token_ids") is None
    for chunk in complete(client, SHORT, stream=True, extra_body={"return_token_ids": False}):
        assert all(extra(c, "token_ids") is None for c in chunk.choices)
    chat = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=2, temperature=0
    )
    assert extra(chat, "prompt_token_ids") is None and extra(chat.choices[0], "token_ids") is None


def as_id(token: str) -> int:
    match = re.fullmatch(r"token_id:(\d+)", token)
    assert match, token
    return int(match.group(1))


def test_completion_logprobs_name_tokens_by_id(client: openai.OpenAI) -> None:
    both = {**IDS, "return_tokens_as_token_ids": True}
    choice = complete(client, SHORT, logprobs=2, echo=True, extra_body=both).choices[0]
    plain = complete(client, SHORT, logprobs=2, echo=True).choices[0]
    assert choice.logprobs is not None and plain.logprobs is not None
    ids = [as_id(t) for t in choice.logprobs.tokens or []]
    assert ids == [*extra(choice, "prompt_token_ids"), *extra(choice, "token_ids")]
    assert choice.logprobs.token_logprobs == plain.logprobs.token_logprobs
    generated_from = len(extra(choice, "prompt_token_ids"))
    for position, (token, top, plain_top) in enumerate(
        zip(
            choice.logprobs.tokens or [],
            choice.logprobs.top_logprobs or [],
            plain.logprobs.top_logprobs or [],
            strict=True,
        )
    ):
        if top is None:  # the echoed first token: nothing before it to score it by
            continue
        assert len(top) == len(plain_top)
        assert sorted(top.values()) == sorted(plain_top.values())
        assert all(as_id(key) >= 0 for key in top)
        if position >= generated_from:  # greedy: a generated token is its step's best
            assert token in top


def test_chat_logprobs_name_tokens_by_id(
    kvrelay_server: ServerProcess, client: openai.OpenAI
) -> None:
    reply = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={**IDS, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert [as_id(e.token) for e in entries] == extra(choice, "token_ids")
    for entry in entries:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert all(as_id(top.token) >= 0 for top in entry.top_logprobs)
