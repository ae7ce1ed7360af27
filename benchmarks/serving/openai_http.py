"""One streamed request to an OpenAI-compatible server, timed as `vllm bench serve` times it.

Completions (`/v1/completions`) and chat (`/v1/chat/completions`) endpoints, SSE streaming with
`stream_options.include_usage`; errors are recorded on the record, never raised.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .dataset import SampleRequest
from .records import RequestRecord


@dataclass(frozen=True)
class EndpointConfig:
    api_url: str  # base URL + endpoint
    model: str
    ignore_eos: bool = True  # ask for exactly output_len tokens (min_tokens = max_tokens too)
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every payload

    @property
    def is_chat(self) -> bool:
        return self.api_url.rstrip("/").endswith("chat/completions")


def build_payload(config: EndpointConfig, request: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model,
        "temperature": 0.0,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.is_chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if config.ignore_eos:
        # vLLM's extensions; servers that do not know them ignore them (or the run says so).
        payload["ignore_eos"] = True
        payload["min_tokens"] = request.output_len
    payload.update(config.extra_body)
    return payload


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def _is_finish_marker(choice: dict[str, Any], chat: bool) -> bool:
    """A chunk that only closes the stream (no text, a finish reason), as llama.cpp's server
    sends after the last token; counting it as a token would add a near-zero ITL."""
    return bool(choice.get("finish_reason")) and not _choice_text(choice, chat)


async def send_request(
    client: httpx.AsyncClient, config: EndpointConfig, request: SampleRequest
) -> RequestRecord:
    """Send one request and time its chunks (perf_counter seconds)."""
    record = RequestRecord(prompt_len=request.prompt_len, max_tokens=request.output_len)
    payload = build_payload(config, request)
    texts: list[str] = []
    start = last = time.perf_counter()
    record.start_time = start
    try:
        async with client.stream("POST", config.api_url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                return record
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(data)
                choices = chunk.get("choices")
                if choices and choices[0].get("finish_reason"):
                    record.finish_reason = str(choices[0]["finish_reason"])
                if choices and not _is_finish_marker(choices[0], config.is_chat):
                    # Any other chunk with a choice is a token event, even an empty text (a
                    # special token): the first sets TTFT, the rest are inter-token gaps.
                    if record.token_chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    record.token_chunks += 1
                    texts.append(_choice_text(choices[0], config.is_chat))
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"].get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.generated_text = "".join(texts)
    record.latency = last - start
    if record.token_chunks:
        record.success = True
    else:
        record.error = "no chunk with a choice arrived, so there is no TTFT"
    return record
