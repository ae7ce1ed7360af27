"""vLLM's request_id (the body field, or the X-Request-Id header, which wins) against the
session's P/D server with the real `openai` client: it names the response (`cmpl-` /
`chatcmpl-` + it, whole and streamed) and is never a key inside, so two requests that send
the same one both run as if alone. Too long is a 400 naming where it came from."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import openai
import pytest

from tests.api.test_return_token_ids import CHAT, LONG, SHORT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


def complete(client: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, **kw)


def test_the_body_field_names_the_response(client: openai.OpenAI) -> None:
    assert complete(client, SHORT, extra_body={"request_id": "job-17"}).id == "cmpl-job-17"
    chunks = list(complete(client, SHORT, stream=True, extra_body={"request_id": "job-18"}))
    assert {c.id for c in chunks} == {"cmpl-job-18"}
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, extra_body={"request_id": "job-19"}
    )
    assert chat.id == "chatcmpl-job-19"
    unnamed = complete(client, SHORT)
    assert unnamed.id.startswith("cmpl-") and "job" not in unnamed.id


def test_the_header_wins_over_the_body(client: openai.OpenAI) -> None:
    reply = complete(
        client, SHORT, extra_body={"request_id": "from-body"},
        extra_headers={"X-Request-Id": "from-header"},
    )  # fmt: skip
    assert reply.id == "cmpl-from-header"


def test_one_id_sent_twice_at_once_is_two_requests(client: openai.OpenAI) -> None:
    alone = [complete(client, p).choices[0].text for p in (SHORT, LONG)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(complete, client, p, extra_body={"request_id": "same"})
            for p in (SHORT, LONG, SHORT, LONG)
        ]
        replies = [f.result() for f in futures]
    assert [r.choices[0].text for r in replies] == alone * 2
    assert {r.id for r in replies} == {"cmpl-same"}


def test_too_long_is_a_400_naming_its_source(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as body:
        complete(client, SHORT, extra_body={"request_id": "x" * 257})
    assert body.value.body is not None and body.value.body["param"] == "request_id"
    with pytest.raises(openai.BadRequestError) as header:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_headers={"X-Request-Id": "y" * 300}
        )
    assert header.value.body is not None and header.value.body["param"] == "X-Request-Id"
