"""Issue 39's endpoints with the real `openai` client against real servers on loopback: the
session's P/D server (prompts over 16 tokens prefill on the prefill worker, shorter ones run
whole on the decode worker) and a colocated one with an API key: /tokenize, /detokenize,
/version, a list of prompts in /v1/completions, echo, and prompt_logprobs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import kvrelay
from tests.api.metrics import wait_for
from tests.servers import ServerProcess, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "issue-39-key"
SHORT = "The capital of France is"  # 5 tokens: decode-only
LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def colocated(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("colocated"), "--colocated", env={"KVRELAY_API_KEY": KEY}
    )
    yield server
    server.stop()


def post(server: ServerProcess, path: str, body: Any, key: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{server.http_url}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"content-type": "application/json"},
        method="POST" if body is not None else "GET",
    )
    if key is not None:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def refused(server: ServerProcess, path: str, body: Any, param: str, key: str | None = None) -> str:
    status, reply = post(server, path, body, key)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    return str(reply["error"]["message"])


def greedy(client: openai.OpenAI, prompt: Any, max_tokens: int = 8, **kw: Any) -> Any:
    return client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


# -- /tokenize, /detokenize, /version --


def test_tokenize_equals_the_tokenizer(kvrelay_server: ServerProcess, tokenizer: Any) -> None:
    status, reply = post(kvrelay_server, "/tokenize", {"prompt": LONG, "return_token_strs": True})
    assert status == 200
    ids = tokenizer(LONG)["input_ids"]
    assert reply["tokens"] == ids and reply["count"] == len(ids)
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert reply["max_model_len"] > len(ids)
    _, plain = post(kvrelay_server, "/tokenize", {"prompt": LONG, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer(LONG, add_special_tokens=False)["input_ids"]
    assert "token_strs" not in plain
    _, empty = post(kvrelay_server, "/tokenize", {"prompt": ""})
    assert empty["count"] == len(empty["tokens"]) == len(tokenizer("")["input_ids"])


def test_tokenize_chat_is_what_chat_completions_runs(
    kvrelay_server: ServerProcess, client: openai.OpenAI, tokenizer: Any
) -> None:
    status, reply = post(kvrelay_server, "/tokenize", {"messages": CHAT})
    assert status == 200
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert reply["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=1, temperature=0
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == reply["count"]
    _, bare = post(kvrelay_server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert reply["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < reply["count"]
    turns = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    body = {"messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    _, going_on = post(kvrelay_server, "/tokenize", body)
    assert tokenizer.decode(going_on["tokens"]).endswith("Red, green and")


def test_detokenize_round_trips(kvrelay_server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer(LONG, add_special_tokens=False)["input_ids"]
    status, reply = post(kvrelay_server, "/detokenize", {"tokens": ids})
    assert status == 200 and reply == {"prompt": LONG}


def test_bad_input_is_a_400_naming_the_field(kvrelay_server: ServerProcess) -> None:
    server = kvrelay_server
    assert "outside the vocabulary" in refused(server, "/detokenize", {"tokens": [10**7]}, "tokens")
    refused(server, "/detokenize", {"tokens": "abc"}, "tokens")
    refused(server, "/tokenize", {"prompt": "x", "model": "gpt-4"}, "model")
    refused(server, "/detokenize", {"tokens": [1], "model": "gpt-4"}, "model")
    refused(
        server,
        "/tokenize",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        ("messages.0.role"),
    )
    refused(server, "/tokenize", {"messages": []}, "messages")
    refused(server, "/tokenize", {"prompt": 3}, "prompt")
    refused(server, "/tokenize", {"prompt": "x", "add_bos": True}, "add_bos")
    both = {"messages": CHAT, "continue_final_message": True}
    refused(server, "/tokenize", both, "continue_final_message")


def test_version(kvrelay_server: ServerProcess) -> None:
    assert post(kvrelay_server, "/version", None) == (200, {"version": kvrelay.__version__})


def test_the_api_key_guards_them(colocated: ServerProcess) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert post(colocated, path, body)[0] == 401
        assert post(colocated, path, body, "wrong")[0] == 401
        assert post(colocated, path, body, KEY)[0] == 200
    assert post(colocated, "/version", None)[0] == 401
    assert post(colocated, "/version", None, KEY) == (200, {"version": kvrelay.__version__})


# -- a list of prompts --


def test_a_list_of_prompts_equals_single_requests(client: openai.OpenAI) -> None:
    singles = [greedy(client, p).choices[0].text for p in (SHORT, LONG)]
    reply = greedy(client, [SHORT, LONG], n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert reply.usage is not None
    one = [greedy(client, p).usage for p in (SHORT, LONG)]
    assert reply.usage.prompt_tokens == sum(u.prompt_tokens for u in one if u)
    assert reply.usage.completion_tokens == 2 * sum(u.completion_tokens for u in one if u)


def test_a_list_of_token_id_prompts(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = [tokenizer(p)["input_ids"] for p in (LONG, SHORT)]
    reply = greedy(client, ids)
    assert [c.text for c in reply.choices] == [greedy(client, p).choices[0].text for p in ids]


def test_a_list_of_prompts_streamed_keeps_the_indices(client: openai.OpenAI) -> None:
    whole = greedy(client, [LONG, SHORT, LONG], max_tokens=10)
    stream = greedy(
        client, [LONG, SHORT, LONG], max_tokens=10, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finished[choice.index] = choice.finish_reason or finished.get(choice.index)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_one_bad_prompt_refuses_them_all(
    kvrelay_server: ServerProcess, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        greedy(client, [[1, 2, 3], [10**7]])
    assert bad.value.body["param"] == "prompt.1"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as many:
        greedy(client, [SHORT] * 7)  # the server admits 4 + 2 queued at most
    assert many.value.body["param"] == "prompt"  # type: ignore[index]
    # Nothing was left admitted or queued by the refused lists.
    wait_for(
        kvrelay_server,
        lambda s: (
            s.value("kvrelay_router_requests_in_flight") == 0
            and s.value("kvrelay_router_requests_queued") == 0
        ),
    )
    assert greedy(client, SHORT).choices[0].text


# -- echo and prompt_logprobs --


def test_echo_prepends_the_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    plain = [greedy(client, p).choices[0].text for p in (SHORT, LONG)]
    echoed = greedy(client, [SHORT, LONG], echo=True)
    assert [c.text for c in echoed.choices] == [SHORT + plain[0], LONG + plain[1]]
    ids = tokenizer(SHORT)["input_ids"]
    by_ids = greedy(client, ids, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain[0]
    streamed = greedy(client, LONG, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == LONG + plain[1]


def test_echo_with_logprobs_and_no_tokens_is_the_prompt_alone(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    reply = greedy(client, LONG, max_tokens=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    ids = tokenizer(LONG)["input_ids"]
    assert choice.text == LONG and choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    logprobs = choice.logprobs.token_logprobs
    assert logprobs is not None and logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs[1:])
    tops = choice.logprobs.top_logprobs
    assert tops is not None and tops[0] is None and all(len(t) == 2 for t in tops[1:])
    assert reply.usage is not None and reply.usage.completion_tokens == 0
    # The same numbers vLLM's prompt_logprobs gives.
    scored = greedy(client, LONG, max_tokens=1, extra_body={"prompt_logprobs": 0})
    entries = scored.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    for token, logprob, entry in zip(ids[1:], logprobs[1:], entries[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-5)


def test_echo_with_logprobs_then_generated_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    reply = greedy(client, [SHORT, LONG], max_tokens=4, echo=True, logprobs=1, n=2)
    for choice in reply.choices:
        prompt = (SHORT, LONG)[choice.index // 2]
        assert choice.text.startswith(prompt)
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        num_prompt = len(tokenizer(prompt)["input_ids"])
        assert len(choice.logprobs.token_logprobs) == num_prompt + 4
        assert choice.logprobs.token_logprobs[0] is None


def check_prompt_logprobs(entries: list[Any], ids: list[int], k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        mine = entry[str(token)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1
        assert mine["decoded_token"] is not None
        assert k <= len(entry) <= k + 1
        ranks = sorted(v["rank"] for key, v in entry.items() if key != str(token) or v["rank"] <= k)
        assert ranks[:k] == list(range(1, k + 1))


def test_prompt_logprobs_pd_equal_colocated(
    client: openai.OpenAI, colocated: ServerProcess, tokenizer: Any
) -> None:
    ids = tokenizer(LONG)["input_ids"]
    body = {"prompt_logprobs": 3}
    pd = greedy(client, LONG, max_tokens=4, extra_body=body)  # prefilled on the prefill worker
    local = openai.OpenAI(base_url=f"{colocated.http_url}/v1", api_key=KEY, max_retries=0)
    here = greedy(local, LONG, max_tokens=4, extra_body=body)
    assert pd.choices[0].text == here.choices[0].text
    a, b = pd.choices[0].prompt_logprobs, here.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    check_prompt_logprobs(a, ids, 3)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key]["logprob"] == pytest.approx(y[key]["logprob"], abs=1e-4)
            assert x[key]["rank"] == y[key]["rank"]
    short = greedy(client, [SHORT, LONG], extra_body={"prompt_logprobs": 1})
    check_prompt_logprobs(short.choices[0].prompt_logprobs, tokenizer(SHORT)["input_ids"], 1)  # type: ignore[attr-defined]
    check_prompt_logprobs(short.choices[1].prompt_logprobs, ids, 1)  # type: ignore[attr-defined]
    assert greedy(client, SHORT).choices[0].model_extra.get("prompt_logprobs") is None


def test_chat_prompt_logprobs(client: openai.OpenAI, kvrelay_server: ServerProcess) -> None:
    reply = client.chat.completions.create(
        model=kvrelay_server.model,
        messages=CHAT,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    _, tokenized = post(kvrelay_server, "/tokenize", {"messages": CHAT})
    check_prompt_logprobs(reply.prompt_logprobs, tokenized["tokens"], 2)  # type: ignore[attr-defined]


def test_prompt_logprobs_refusals(kvrelay_server: ServerProcess) -> None:
    streamed = {"prompt": SHORT, "stream": True, "prompt_logprobs": 1}
    refused(kvrelay_server, "/v1/completions", streamed, "prompt_logprobs")
    chat = {"messages": CHAT, "stream": True, "prompt_logprobs": 0}
    refused(kvrelay_server, "/v1/chat/completions", chat, "prompt_logprobs")
    too_many = {"prompt": SHORT, "prompt_logprobs": 21}
    refused(kvrelay_server, "/v1/completions", too_many, "prompt_logprobs")
    refused(kvrelay_server, "/v1/completions", {"prompt": SHORT, "max_tokens": 0}, "max_tokens")


def test_colocated_list_echo_streamed(colocated: ServerProcess) -> None:
    local = openai.OpenAI(base_url=f"{colocated.http_url}/v1", api_key=KEY, max_retries=0)
    whole = greedy(local, [LONG, SHORT], n=2, echo=True, seed=3)
    stream = greedy(local, [LONG, SHORT], n=2, echo=True, seed=3, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    prompts = [LONG, LONG, SHORT, SHORT]
    assert all(c.text.startswith(p) for c, p in zip(whole.choices, prompts, strict=True))
    wait_for(colocated, lambda s: s.value("kvrelay_router_requests_in_flight") == 0)


def test_tokenize_chat_takes_template_variables_and_names(kvrelay_server: ServerProcess) -> None:
    _, plain = post(kvrelay_server, "/tokenize", {"messages": CHAT})
    named = [{**CHAT[0], "name": "ada"}, *CHAT[1:]]
    body = {"messages": named, "chat_template_kwargs": {"enable_thinking": False}}
    status, reply = post(kvrelay_server, "/tokenize", body)
    # SmolLM2's template reads neither: the same tokens (the router's unit tests use one that does)
    assert status == 200 and reply["tokens"] == plain["tokens"]
    refused(
        kvrelay_server,
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs.add_generation_prompt",
    )
