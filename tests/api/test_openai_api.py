"""The real `openai` client against a real `kvrelay serve` (Ray, a prefill and a decode worker,
the router, uvicorn) on loopback."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.llm import LLM
from tests.api.metrics import pools_idle, scrape, wait_for
from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(kvrelay_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{kvrelay_server.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(default_model_dir: Any) -> LLM:
    """The same model in-process: what the server's greedy outputs must equal."""
    return LLM(str(default_model_dir), num_threads=1)


def greedy_text(llm: LLM, prompt: Any, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_models(client: openai.OpenAI, kvrelay_server: ServerProcess) -> None:
    ids = [model.id for model in client.models.list()]
    assert ids == [kvrelay_server.model]


def test_chat_whole_equals_offline_greedy(
    client: openai.OpenAI, offline: LLM, kvrelay_server: ServerProcess
) -> None:
    before = scrape(kvrelay_server)
    reply = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=24, temperature=0
    )
    expected = greedy_text(offline, offline.chat_prompt(CHAT), 24)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    prompt_ids = offline.chat_prompt(CHAT)["prompt_token_ids"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    completion_ids = offline.get_tokenizer()(expected, add_special_tokens=False)["input_ids"]
    assert reply.usage.completion_tokens in (len(completion_ids), 24)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # A 30-token chat prompt is over the 16-token threshold: it went prefill -> relay -> decode.
    after = scrape(kvrelay_server)
    assert after.value("kvrelay_disaggregation_decisions_total", decision="disaggregated") > (
        before.value("kvrelay_disaggregation_decisions_total", decision="disaggregated")
    )


def test_chat_streamed_equals_whole_with_usage(
    client: openai.OpenAI, kvrelay_server: ServerProcess
) -> None:
    whole = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=20, temperature=0
    )
    stream = client.chat.completions.create(
        model=kvrelay_server.model,
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and finishes.count(None) >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_completions_short_prompt_runs_on_the_decode_worker(
    client: openai.OpenAI, offline: LLM, kvrelay_server: ServerProcess
) -> None:
    before = scrape(kvrelay_server)
    prompt = "The capital of France is"
    reply = client.completions.create(
        model=kvrelay_server.model, prompt=prompt, max_tokens=12, temperature=0
    )
    assert reply.choices[0].text == greedy_text(offline, prompt, 12)
    assert reply.usage is not None and reply.usage.prompt_tokens == 5
    after = scrape(kvrelay_server)
    key = ("kvrelay_disaggregation_decisions_total", "decode_only")
    assert after.value(key[0], decision=key[1]) > before.value(key[0], decision=key[1])


def test_completions_streamed(
    client: openai.OpenAI, offline: LLM, kvrelay_server: ServerProcess
) -> None:
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    stream = client.completions.create(
        model=kvrelay_server.model, prompt=prompt, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == greedy_text(offline, prompt, 16)


def test_n_samples_seeded_and_distinct(
    client: openai.OpenAI, kvrelay_server: ServerProcess
) -> None:
    kwargs: dict[str, Any] = dict(
        model=kvrelay_server.model,
        prompt="My favourite animal is",
        max_tokens=12,
        n=2,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs, temperature=1.0, seed=7)
    again = client.completions.create(**kwargs, temperature=1.0, seed=7)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert first.choices[0].text != first.choices[1].text  # sample i draws from seed + i
    assert first.usage is not None
    assert first.usage.completion_tokens == 24  # both samples count
    greedy = client.completions.create(**kwargs, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_stop_strings(client: openai.OpenAI, kvrelay_server: ServerProcess) -> None:
    base: dict[str, Any] = dict(
        model=kvrelay_server.model, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0
    )
    free = client.completions.create(**base).choices[0]
    assert " 7" in free.text
    cut = client.completions.create(**base, stop=[" 7"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(" 7")]
    assert cut.model_extra is not None and cut.model_extra["stop_reason"] == " 7"
    kept = client.completions.create(
        **base, stop=[" 7"], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == cut.text + " 7"


def test_logprobs(client: openai.OpenAI, kvrelay_server: ServerProcess) -> None:
    reply = client.completions.create(
        model=kvrelay_server.model, prompt="The capital of France is", max_tokens=4,
        temperature=0, logprobs=3,
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.top_logprobs is not None and logprobs.token_logprobs is not None
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and max(top.values()) == pytest.approx(logprob)  # greedy: the top
        assert top[token] == pytest.approx(logprob)
    chat = client.chat.completions.create(
        model=kvrelay_server.model, messages=CHAT, max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_vllm_extra_fields(client: openai.OpenAI, kvrelay_server: ServerProcess) -> None:
    reply = client.completions.create(
        model=kvrelay_server.model,
        prompt="Hi",
        max_tokens=6,
        extra_body={
            "top_k": 5, "min_p": 0.05, "min_tokens": 6, "ignore_eos": True,
            "repetition_penalty": 1.1, "stop_token_ids": [],
        },
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    assert reply.choices[0].finish_reason == "length"


def test_logit_bias_forces_and_bans_tokens(
    client: openai.OpenAI, offline: LLM, kvrelay_server: ServerProcess
) -> None:
    """OpenAI's logit_bias (token ids as string keys), through the real client: +100 makes
    greedy repeat one token; -100 on every token greedy chose keeps each of them out, and
    the server's text is the offline engine's under the same bias."""
    tokenizer = offline.get_tokenizer()
    token = tokenizer(" blue", add_special_tokens=False)["input_ids"][0]
    forced = client.completions.create(
        model=kvrelay_server.model, prompt="Colours:", max_tokens=5, temperature=0,
        logit_bias={str(token): 100},
    )  # fmt: skip
    assert forced.choices[0].text == tokenizer.decode([token] * 5)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    chosen = offline.generate(["Colours:"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    bias = {t: -100.0 for t in chosen}
    biased = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=bias)
    expected = offline.generate(["Colours:"], biased, use_tqdm=False)[0].outputs[0]
    assert set(expected.token_ids).isdisjoint(chosen)
    banned = client.completions.create(
        model=kvrelay_server.model, prompt="Colours:", max_tokens=6, temperature=0,
        logit_bias={str(t): -100 for t in chosen},
    )  # fmt: skip
    assert banned.choices[0].text == expected.text


BAD_REQUESTS = [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": "two"}, "n"),
    ({"model": "no-such-model"}, "model"),
    ({"prompt": "hello " * 9000}, "prompt"),
    ({"max_tokens": 9000}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
]


@pytest.mark.parametrize(("override", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_bad_input_is_a_400_naming_the_field(
    kvrelay_server: ServerProcess, override: dict[str, Any], param: str
) -> None:
    body = {"model": kvrelay_server.model, "prompt": "Hello", "max_tokens": 4, **override}
    status, reply = post(kvrelay_server, "/v1/completions", json.dumps(body).encode())
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"] or param == "prompt"


def test_malformed_json_is_a_400(kvrelay_server: ServerProcess) -> None:
    status, reply = post(kvrelay_server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400
    assert "JSON" in reply["error"]["message"]


def test_empty_messages_is_a_400(kvrelay_server: ServerProcess) -> None:
    body = {"model": kvrelay_server.model, "messages": []}
    status, reply = post(kvrelay_server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "messages"


def post(server: ServerProcess, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        server.http_url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_stop_string_aborts_the_worker(
    client: openai.OpenAI, kvrelay_server: ServerProcess
) -> None:
    """The router matches stop strings; the worker, told nothing of them, must be aborted
    when one matches, not left generating 1000 tokens nobody reads."""
    wait_for(kvrelay_server, pools_idle)
    reply = client.completions.create(
        model=kvrelay_server.model,
        prompt="1, 2, 3, 4,",
        max_tokens=1000,
        temperature=0,
        stop=[" 9"],
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "stop"
    idle = wait_for(kvrelay_server, pools_idle, timeout_s=5)
    assert pools_idle(idle), idle.samples
