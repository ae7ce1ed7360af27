"""Client behaviour over the wire against a scripted fake server: retries, retry-after,
no re-send after the first token, deadlines, metadata and health. Fast; no model."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvrelay.client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    OverloadedError,
    RetryEvent,
    RetryPolicy,
    UnavailableError,
)
from tests.client.fake_server import Answer, Fail, FakeServer
from tests.servers import free_port

FAST = RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.05)
UNAVAILABLE = Fail(grpc.StatusCode.UNAVAILABLE, "draining")


@pytest.mark.parametrize("stream", [False, True])
def test_unavailable_twice_then_success(stream: bool) -> None:
    events: list[RetryEvent] = []
    with (
        FakeServer([UNAVAILABLE, UNAVAILABLE, Answer()]) as server,
        Client(server.target, retry_policy=FAST, on_retry=events.append) as client,
    ):
        if stream:
            text = "".join(c.choices[0].text for c in client.generate("hi", stream=True))
        else:
            text = client.generate("hi").text
    assert text == "Hello, world"
    assert server.attempts == 3
    assert [e.attempt for e in events] == [0, 1]
    assert all(isinstance(e.error, UnavailableError) for e in events)


def test_gives_up_after_max_retries() -> None:
    events: list[RetryEvent] = []
    with FakeServer([UNAVAILABLE]) as server:
        client = Client(server.target, retry_policy=FAST, max_retries=2, on_retry=events.append)
        with client, pytest.raises(UnavailableError, match="draining"):
            client.generate("hi")
    assert server.attempts == 3 and len(events) == 2


def test_never_resends_after_the_first_token() -> None:
    with (
        FakeServer([Fail(grpc.StatusCode.UNAVAILABLE, after=1)]) as server,
        Client(server.target, retry_policy=FAST) as client,
    ):
        stream = client.generate("hi", stream=True)
        first = next(stream)
        with pytest.raises(UnavailableError):
            next(stream)
        # A whole (non-streamed) call fails the same way: a token was sent, the error is final.
        with pytest.raises(UnavailableError):
            client.generate("hi")
    assert first.choices[0].text == "tok"
    assert server.attempts == 2  # one per call, neither re-sent


def test_retry_after_is_honoured() -> None:
    events: list[RetryEvent] = []
    full = Fail(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", trailing=(("retry-after", "0.3"),)
    )
    with (
        FakeServer([full, Answer()]) as server,
        Client(server.target, retry_policy=FAST, on_retry=events.append) as client,
    ):
        start = time.monotonic()
        assert client.generate("hi").text == "Hello, world"
        elapsed = time.monotonic() - start
    [event] = events
    assert isinstance(event.error, OverloadedError) and event.error.retry_after == 0.3
    assert event.delay == pytest.approx(0.3) and elapsed >= 0.3


def test_overloaded_error_carries_retry_after_when_retries_run_out() -> None:
    full = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", trailing=(("retry-after", "7"),))
    with (
        FakeServer([full]) as server,
        Client(server.target, max_retries=0) as client,
        pytest.raises(OverloadedError) as info,
    ):
        client.generate("hi")
    assert info.value.retry_after == 7.0


def test_deadline_bounds_the_retries() -> None:
    slow = RetryPolicy(max_retries=10, initial_backoff=0.2, multiplier=1.0, jitter=0.0)
    with (
        FakeServer([UNAVAILABLE]) as server,
        Client(server.target, retry_policy=slow, timeout=0.5) as client,
    ):
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.generate("hi")
        elapsed = time.monotonic() - start
    # 0.2 s waits fit twice into 0.5 s; the third would outlast the deadline, so it stops.
    assert server.attempts == 3 and elapsed < 0.6


def test_invalid_argument_is_not_retried() -> None:
    bad = Fail(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0, got -1.0")
    with (
        FakeServer([bad]) as server,
        Client(server.target, retry_policy=FAST) as client,
        pytest.raises(InvalidArgumentError, match="temperature"),
    ):
        client.generate("hi", temperature=-1.0)
    assert server.attempts == 1


def test_unreachable_server_retries_then_raises_unavailable() -> None:
    events: list[RetryEvent] = []
    policy = RetryPolicy(initial_backoff=0.1, jitter=0.0)
    client = Client(
        f"127.0.0.1:{free_port()}", max_retries=2, retry_policy=policy, on_retry=events.append
    )
    start = time.monotonic()
    with client, pytest.raises(UnavailableError):
        client.generate("hi", max_tokens=2)
    elapsed = time.monotonic() - start
    assert [e.delay for e in events] == [pytest.approx(0.1), pytest.approx(0.2)]
    assert elapsed >= 0.3  # both backoff sleeps happened
    assert not Client(f"127.0.0.1:{free_port()}", timeout=1.0).health()


def test_api_key_and_request_fields_are_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_API_KEY", "sk-env")
    with FakeServer([Answer()]) as server:
        with Client(server.target) as client:
            client.generate([5, 6], model="m", request_id="req-9", max_tokens=4, stop=["."])
        with Client(server.target, api_key="sk-arg") as client:
            client.models()
    first, second = server.script.metadata
    assert first["authorization"] == "Bearer sk-env" and second["authorization"] == "Bearer sk-arg"
    request = server.script.requests[0]
    assert request.request_id == "req-9" and request.model == "m" and not request.stream
    assert list(request.prompt_token_ids.ids) == [5, 6] and request.sampling.max_tokens == 4


def test_unknown_keyword_fails_before_any_call() -> None:
    with (
        FakeServer([Answer()]) as server,
        Client(server.target) as client,
        pytest.raises(TypeError, match="max_token"),
    ):
        client.generate("hi", max_token=3)
    assert server.attempts == 0


def test_sync_models_and_health() -> None:
    with FakeServer([Answer()]) as server, Client(server.target) as client:
        assert [m.id for m in client.models()] == ["fake-model"]
        assert client.health()
        server.health.set("", 2)  # NOT_SERVING
        assert not client.health()


def test_async_client_end_to_end_against_the_fake() -> None:
    async def run(target: str) -> tuple[str, str, list[str], bool]:
        async with AsyncClient(target, retry_policy=FAST) as client:
            whole = await client.generate("hi")
            stream = await client.generate("hi", stream=True)
            streamed = "".join([c.choices[0].text async for c in stream])
            models = [m.id for m in await client.models()]
            return whole.text, streamed, models, await client.health()

    with FakeServer([UNAVAILABLE, Answer()]) as server:
        whole, streamed, models, healthy = asyncio.run(run(server.target))
    assert whole == streamed == "Hello, world"
    assert models == ["fake-model"] and healthy
    assert server.attempts == 4  # one retried Generate, one more Generate, ListModels


def test_async_never_resends_after_the_first_token() -> None:
    async def run(target: str) -> str:
        async with AsyncClient(target, retry_policy=FAST) as client:
            stream = await client.generate("hi", stream=True)
            first = await stream.__anext__()
            with pytest.raises(UnavailableError):
                await stream.__anext__()
            return first.choices[0].text

    with FakeServer([Fail(grpc.StatusCode.UNAVAILABLE, after=1), Answer()]) as server:
        assert asyncio.run(run(server.target)) == "tok"
    assert server.attempts == 1


def test_async_deadline_exceeded_before_sending() -> None:
    async def run(target: str) -> None:
        async with AsyncClient(
            target, retry_policy=RetryPolicy(initial_backoff=0.3, jitter=0)
        ) as c:
            await c.generate("hi", timeout=0.2)

    with FakeServer([UNAVAILABLE]) as server, pytest.raises(UnavailableError):
        asyncio.run(run(server.target))
    assert server.attempts == 1  # the 0.3 s backoff would outlast the 0.2 s deadline
    with pytest.raises(ValueError, match="timeout"):
        Client("127.0.0.1:1", timeout=-1)
    assert DeadlineExceededError  # exported
