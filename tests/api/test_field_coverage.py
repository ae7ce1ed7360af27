"""No request field silently ignored (issue 39): every field of OpenAI's request schemas, read
from the installed `openai` package, and every extra field of vLLM's, is sent with a plausible
value to a real server; the answer is 200 or a 400 whose `param` names the field. The fields
kvrelay implements must answer 200; the ones it accepts at one value only (a value that changes
nothing here) answer 200 at that value and 400 at another.

vLLM's fields are those of vllm-project/vllm at commit d5dba2d7 (vllm/entrypoints/openai/
chat_completion/protocol.py and completion/protocol.py: ChatCompletionRequest and
CompletionRequest), the StructuredOutputsParams sub-fields of vllm/sampling_params.py there,
and the older guided_* fields of vllm/entrypoints/openai/protocol.py (v0.10-era), which vLLM
clients still send.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from tests.servers import ServerProcess

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASES: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 2},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# field -> (a plausible value, other fields it needs). Both endpoints unless overridden below.
VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    # OpenAI
    "audio": ({"voice": "alloy", "format": "wav"}, {}),
    "best_of": (1, {}),
    "echo": (True, {}),
    "frequency_penalty": (0.5, {}),
    "function_call": ("auto", {}),
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], {}),
    "logit_bias": ({"1": -100}, {}),
    "max_completion_tokens": (2, {}),
    "max_tokens": (2, {}),
    "metadata": ({"team": "search"}, {}),
    "modalities": (["text", "audio"], {}),
    "model": ("SmolLM2-135M-Instruct", {}),
    "moderation": ({"model": "omni-moderation-latest"}, {}),
    "n": (2, {}),
    "parallel_tool_calls": (False, {"tools": [TOOL]}),
    "prediction": ({"type": "content", "content": "Hello"}, {}),
    "presence_penalty": (0.5, {}),
    "prompt_cache_key": ("user-42", {}),
    "prompt_cache_options": ({"mode": "implicit"}, {}),
    "prompt_cache_retention": ("24h", {}),
    "reasoning_effort": ("low", {}),
    "response_format": ({"type": "json_object"}, {}),
    "safety_identifier": ("user-42", {}),
    "seed": (7, {}),
    "service_tier": ("flex", {}),
    "stop": (["\n"], {}),
    "store": (True, {}),
    "stream": (True, {}),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, {"stream": True}),
    "suffix": (" world", {}),
    "temperature": (0.5, {}),
    "tool_choice": ("none", {"tools": [TOOL]}),
    "tools": ([TOOL], {}),
    "top_logprobs": (2, {"logprobs": True}),
    "top_p": (0.9, {}),
    "user": ("user-42", {}),
    "verbosity": ("low", {}),
    "web_search_options": ({"search_context_size": "low"}, {}),
    # vLLM's sampling and extra parameters
    "use_beam_search": (True, {}),
    "top_k": (5, {}),
    "min_p": (0.1, {}),
    "repetition_penalty": (1.1, {}),
    "length_penalty": (0.8, {}),
    "stop_token_ids": ([2], {}),
    "include_stop_str_in_output": (True, {}),
    "ignore_eos": (True, {}),
    "min_tokens": (1, {}),
    "skip_special_tokens": (False, {}),
    "spaces_between_special_tokens": (False, {}),
    "truncate_prompt_tokens": (8, {}),
    "prompt_logprobs": (1, {}),
    "allowed_token_ids": ([1, 2, 3], {}),
    "bad_words": (["Hello"], {}),
    "include_reasoning": (False, {}),
    "add_generation_prompt": (True, {}),
    "continue_final_message": (True, {"add_generation_prompt": False}),
    "add_special_tokens": (False, {}),
    "documents": ([{"title": "a", "text": "b"}], {}),
    "chat_template": ("{{ messages[0]['content'] }}", {}),
    "chat_template_kwargs": ({"enable_thinking": False}, {}),
    "mm_processor_kwargs": ({"num_crops": 4}, {}),
    "structured_outputs": ({"choice": ["yes", "no"]}, {}),
    "priority": (1, {}),
    "request_id": ("my-request-1", {}),
    "logits_processors": (["my_module.MyProcessor"], {}),
    "return_tokens_as_token_ids": (True, {}),
    "return_token_ids": (True, {}),
    "cache_salt": ("c2FsdA", {}),
    "kv_transfer_params": ({"do_remote_decode": True}, {}),
    "vllm_xargs": ({"tag": "a"}, {}),
    "max_repetition_pattern_size": (4, {}),
    "min_repetition_pattern_size": (2, {}),
    "repetition_min_count": (3, {}),
    "prompt_embeds": ("AAAA", {}),
    # the older guided_* fields
    "guided_json": ({"type": "object"}, {}),
    "guided_regex": ("[a-z]+", {}),
    "guided_choice": (["yes", "no"], {}),
    "guided_grammar": ('start: "yes" | "no"', {}),
    "guided_json_object": (True, {}),
    "guided_decoding_backend": ("guidance", {}),
    "guided_whitespace_pattern": (" ", {}),
    "structural_tag": ('{"structures": [], "triggers": []}', {}),
}
BY_PATH: dict[str, dict[str, tuple[Any, dict[str, Any]]]] = {
    CHAT: {
        "logprobs": (True, {}),
        "messages": (
            [{"role": "system", "content": "Be brief.", "name": "ops"}, BASES[CHAT]["messages"][0]],
            {},
        ),
    },
    COMPLETIONS: {"logprobs": (2, {}), "prompt": ([[1, 2, 3]], {})},
}
VLLM_CHAT = (
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "include_reasoning", "echo",
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
)  # fmt: skip
VLLM_COMPLETION = (
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "prompt_embeds", "add_special_tokens",
    "response_format", "structured_outputs", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size",
    "repetition_min_count",
)  # fmt: skip
GUIDED = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
    "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
)  # fmt: skip
# `stream` is in the streaming variants of the params, not in the Base class.
OPENAI_CHAT = (*chat_params.CompletionCreateParamsBase.__annotations__, "stream")
OPENAI_COMPLETION = (*completion_params.CompletionCreateParamsBase.__annotations__, "stream")
FIELDS = {
    CHAT: sorted({*OPENAI_CHAT, *VLLM_CHAT, *GUIDED}),
    COMPLETIONS: sorted({*OPENAI_COMPLETION, *VLLM_COMPLETION, *GUIDED}),
}

# Implemented: must answer 200 with the value above.
IMPLEMENTED = {
    "frequency_penalty", "logit_bias", "max_tokens", "model", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
    "safety_identifier", "response_format", "structured_outputs", "top_k", "min_p",
    "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_json_object", "guided_decoding_backend", "prompt_logprobs",
    "priority", "return_token_ids", "return_tokens_as_token_ids", "truncate_prompt_tokens",
    "allowed_token_ids", "request_id", "add_special_tokens",
}  # fmt: skip
IMPLEMENTED_CHAT = {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                    "add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice",
                    "parallel_tool_calls"}  # fmt: skip
IMPLEMENTED_COMPLETION = {"prompt", "best_of", "echo"}
# Accepted at one value only (a value that changes nothing here): (accepted, refused).
ACCEPTED_AT: dict[str, tuple[Any, Any]] = {
    "store": (False, True),
    "service_tier": ("auto", "flex"),
    "use_beam_search": (False, True),
    "length_penalty": (1.0, 0.8),
    "max_repetition_pattern_size": (0, 4),
    "min_repetition_pattern_size": (0, 2),
    "repetition_min_count": (0, 3),
    "spaces_between_special_tokens": (True, False),
}
ACCEPTED_AT_BY_PATH: dict[str, dict[str, tuple[Any, Any]]] = {
    CHAT: {
        "modalities": (["text"], ["text", "audio"]),
        "include_reasoning": (True, False),
        "continue_final_message": (False, True),
    },
    COMPLETIONS: {},
}


def _post(server: ServerProcess, path: str, fields: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", json={**BASES[path], **fields}, timeout=120)


def _value(path: str, field: str) -> tuple[Any, dict[str, Any]]:
    return BY_PATH[path].get(field) or VALUES[field]


def _check_field(server: ServerProcess, path: str, field: str) -> str | None:
    """Why `field` fails the rule on `path`, or None."""
    value, companions = _value(path, field)
    reply = _post(server, path, {**companions, field: value})
    implemented = IMPLEMENTED | (IMPLEMENTED_CHAT if path == CHAT else IMPLEMENTED_COMPLETION)
    if field in implemented and reply.status_code != 200:
        return f"implemented, got {reply.status_code}: {reply.text[:300]}"
    if reply.status_code == 200:
        return None
    error = reply.json().get("error", {}) if reply.status_code == 400 else {}
    param = error.get("param") or ""
    if param != field and not param.startswith(f"{field}."):
        return f"{reply.status_code} with param {param!r}: {reply.text[:300]}"
    return None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_field_is_implemented_or_refused_by_name(
    kvrelay_server: ServerProcess, path: str
) -> None:
    missing = [f for f in FIELDS[path] if f not in VALUES and f not in BY_PATH[path]]
    assert not missing, f"give these fields a plausible value: {missing}"
    failures = {f: why for f in FIELDS[path] if (why := _check_field(kvrelay_server, path, f))}
    assert not failures, failures


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_fields_accepted_at_one_value(kvrelay_server: ServerProcess, path: str) -> None:
    for field, (value, refused) in {**ACCEPTED_AT, **ACCEPTED_AT_BY_PATH[path]}.items():
        ok = _post(kvrelay_server, path, {field: value})
        assert ok.status_code == 200, (field, ok.text[:300])
        other = _post(kvrelay_server, path, {field: refused})
        assert other.status_code == 400, (field, other.text[:300])
        assert other.json()["error"]["param"] == field


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True, "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation"),
        ({"structured_outputs": {"whitespace_pattern": " ", "json_object": True}},
         "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"disable_additional_properties": True, "json_object": True}},
         "structured_outputs.disable_additional_properties"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {},
                                                                     "x_extra": 1}}},
         "response_format.json_schema.x_extra"),
        ({"messages": [{"role": "user", "content": "Hi", "audio": {"id": "a"}}]},
         "messages.0.audio"),
        ({"messages": [{"role": "user", "content": "Hi", "name": 7}]}, "messages.0.name"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ],
)  # fmt: skip
def test_nested_fields_are_refused_by_their_dotted_name(
    kvrelay_server: ServerProcess, fields: dict[str, Any], param: str
) -> None:
    reply = _post(kvrelay_server, CHAT, fields)
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(
    kvrelay_server: ServerProcess,
) -> None:
    options = {"continuous_usage_stats": True}
    fields = {"stream": True, "stream_options": options, "max_tokens": 4, "ignore_eos": True}
    reply = _post(kvrelay_server, COMPLETIONS, fields)
    assert reply.status_code == 200
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts and counts == sorted(counts) and counts[-1] == 4, chunks
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
