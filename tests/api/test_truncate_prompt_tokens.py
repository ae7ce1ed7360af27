"""vLLM's truncate_prompt_tokens with the real `openai` client against the session's P/D
server: the prompt's last k tokens run (usage, the returned prompt ids, echo and the tokens
all agree with sending those k tokens), on both endpoints; bad values are a 400 naming it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.api.test_return_token_ids import CHAT, LONG, extra, tokenized
from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


def complete(client: openai.OpenAI, prompt: Any, **extra_body: Any) -> Any:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, **extra_body},
    )  # fmt: skip


def test_a_completion_runs_the_prompts_last_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    full = tokenizer(LONG)["input_ids"]
    cut = complete(client, LONG, truncate_prompt_tokens=7)
    direct = complete(client, full[-7:])
    assert extra(cut.choices[0], "prompt_token_ids") == full[-7:]
    assert cut.usage is not None and cut.usage.prompt_tokens == 7
    assert extra(cut.choices[0], "token_ids") == extra(direct.choices[0], "token_ids")
    assert cut.choices[0].text == direct.choices[0].text
    whole = complete(client, LONG, truncate_prompt_tokens=len(full) + 5)  # nothing to cut
    assert extra(whole.choices[0], "prompt_token_ids") == full
    everything = complete(client, LONG, truncate_prompt_tokens=-1)  # the context's worth
    assert extra(everything.choices[0], "prompt_token_ids") == full


def test_echo_shows_the_prompt_that_ran(client: openai.OpenAI, tokenizer: Any) -> None:
    full = tokenizer(LONG)["input_ids"]
    reply = client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=3, temperature=0, echo=True, logprobs=0,
        extra_body={"truncate_prompt_tokens": 5},
    )  # fmt: skip
    choice = reply.choices[0]
    ran = tokenizer.decode(full[-5:])
    assert choice.text.startswith(ran) and not choice.text.startswith(LONG)
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 5 + 3


def test_a_chat_prompt_is_cut_after_its_template(
    kvrelay_server: ServerProcess, client: openai.OpenAI
) -> None:
    rendered = tokenized(kvrelay_server, {"messages": CHAT})
    reply = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=4, temperature=0,
        extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True},
    )  # fmt: skip
    assert extra(reply, "prompt_token_ids") == rendered[-6:]
    assert reply.usage is not None and reply.usage.prompt_tokens == 6


@pytest.mark.parametrize("value", [0, -2, 10**6])
def test_bad_values_are_a_400_naming_the_field(client: openai.OpenAI, value: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, LONG, truncate_prompt_tokens=value)
    assert info.value.body is not None and info.value.body["param"] == "truncate_prompt_tokens"
    with pytest.raises(openai.BadRequestError) as chat_info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"truncate_prompt_tokens": value}
        )
    assert chat_info.value.body is not None
    assert chat_info.value.body["param"] == "truncate_prompt_tokens"
