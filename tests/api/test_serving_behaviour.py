"""The shared server under pressure: overload, cancelled clients, deadlines; and its gRPC face
(health, reflection, Generate, errors)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvrelay.v1 import generation_pb2 as pb
from kvrelay.v1 import generation_pb2_grpc as pb_grpc
from tests.api.metrics import pools_idle, scrape, wait_for
from tests.servers import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LONG_CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def test_overload_refuses_the_extra_requests_at_once(kvrelay_server: ServerProcess) -> None:
    """Bounds 4 running + 2 queued: of 10 concurrent requests 6 complete, 4 get 429."""

    async def main() -> list[Any]:
        client = openai.AsyncOpenAI(
            base_url=f"{kvrelay_server.http_url}/v1", api_key="x", max_retries=0
        )

        async def one() -> Any:
            started = time.monotonic()
            try:
                reply = await client.completions.create(
                    model=kvrelay_server.model,
                    prompt="The history of the printing press",
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return reply
            except openai.RateLimitError as exc:
                return (exc, time.monotonic() - started)

        return await asyncio.gather(*(one() for _ in range(10)))

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, tuple)]
    served = [r for r in results if not isinstance(r, tuple)]
    assert len(served) == 6 and len(refused) == 4
    for exc, seconds in refused:
        assert exc.status_code == 429 and seconds < 2.0  # refused at once, not after a wait
        assert int(exc.response.headers["retry-after"]) >= 1
        assert exc.body["type"] == "rate_limit_error"  # type: ignore[index]
    texts = {reply.choices[0].text for reply in served}
    assert len(texts) == 1  # every admitted one completed, and correctly (greedy, same prompt)
    assert all(reply.usage.completion_tokens == 24 for reply in served)
    assert (
        scrape(kvrelay_server).value(
            "kvrelay_requests_total", model=kvrelay_server.model, outcome="rejected"
        )
        >= 4
    )


def test_a_client_that_disconnects_frees_its_blocks_at_both_workers(
    kvrelay_server: ServerProcess,
) -> None:
    wait_for(kvrelay_server, pools_idle)
    before = scrape(kvrelay_server)
    body = {
        "model": kvrelay_server.model,
        "messages": LONG_CHAT,
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{kvrelay_server.http_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=60)
    events = 0
    for line in response:
        if line.startswith(b"data: "):
            events += 1
        if events == 4:
            break
    # The router polls worker stats twice a second: wait to see it running at the decode worker.
    busy = wait_for(
        kvrelay_server, lambda s: s.value("kvrelay_num_requests_running", pool="decode") > 0
    )
    response.close()  # the client goes away mid-stream
    idle = wait_for(kvrelay_server, pools_idle, timeout_s=10)
    assert pools_idle(idle), idle.samples
    # It was really running at the decode worker (1000 tokens would take a minute).
    assert busy.value("kvrelay_kv_cache_usage_ratio", pool="decode") > 0
    assert busy.value("kvrelay_num_requests_running", pool="decode") == 1
    assert idle.value(
        "kvrelay_requests_total", model=kvrelay_server.model, outcome="abort"
    ) > before.value("kvrelay_requests_total", model=kvrelay_server.model, outcome="abort")
    # Both workers had the request: prefill (it was disaggregated), then decode.
    assert idle.value("kvrelay_kv_transfer_bytes_total", pool="decode") > before.value(
        "kvrelay_kv_transfer_bytes_total", pool="decode"
    )


@pytest.fixture(scope="module")
def channel(kvrelay_server: ServerProcess) -> Any:
    with grpc.insecure_channel(kvrelay_server.grpc_target) as channel:
        yield channel


def test_grpc_health_and_reflection(channel: Any) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    answer = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    names = {s.name for s in answer.list_services_response.service}
    assert {"kvrelay.v1.Generation", "grpc.health.v1.Health"} <= names


def test_grpc_generate_streamed_equals_whole(channel: Any, kvrelay_server: ServerProcess) -> None:
    stub = pb_grpc.GenerationStub(channel)
    request = pb.GenerateRequest(
        prompt="The capital of France is",
        sampling=pb.SamplingOptions(temperature=0, max_tokens=10, logprobs=1),
        stream=True,
    )
    chunks = list(stub.Generate(request, timeout=60))
    assert all(c.request_id == chunks[0].request_id for c in chunks)
    text = "".join(choice.text for c in chunks for choice in c.choices)
    ids = [t for c in chunks for choice in c.choices for t in choice.token_ids]
    assert chunks[-1].usage.completion_tokens == len(ids) and chunks[-1].usage.prompt_tokens == 5
    logprobs = [lp for c in chunks for choice in c.choices for lp in choice.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    assert all(len(lp.top_logprobs) == 1 for lp in logprobs)
    request.stream = False
    (whole,) = list(stub.Generate(request, timeout=60))
    assert whole.choices[0].text == text and list(whole.choices[0].token_ids) == ids
    assert whole.choices[0].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    models = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    assert [m.id for m in models.models] == [kvrelay_server.model]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p")],
)
def test_grpc_bad_input_is_invalid_argument(
    channel: Any, sampling: dict[str, float], field: str
) -> None:
    stub = pb_grpc.GenerationStub(channel)
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(**sampling))
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(request, timeout=30))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in failure.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        list(stub.Generate(pb.GenerateRequest(prompt="Hi", model="nope"), timeout=30))
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in unknown.value.details()


def test_grpc_deadline_aborts_the_request(channel: Any, kvrelay_server: ServerProcess) -> None:
    wait_for(kvrelay_server, pools_idle)
    stub = pb_grpc.GenerationStub(channel)
    request = pb.GenerateRequest(
        prompt="Tell me everything about the ocean.",
        sampling=pb.SamplingOptions(max_tokens=1000, ignore_eos=True),
        stream=True,
    )
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(request, timeout=1.5))
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    idle = wait_for(kvrelay_server, pools_idle, timeout_s=10)
    assert pools_idle(idle), idle.samples
