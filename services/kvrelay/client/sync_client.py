"""`Client`: the blocking kvrelay SDK over a `grpc.Channel`.

Retries (see `retry.py`) happen only until a call's first response arrives; after that an error
ends the stream with a typed exception and nothing is re-sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvrelay.client.convert import (
    ResultAssembler,
    build_request,
    chunk_from_proto,
    model_from_proto,
)
from kvrelay.client.errors import DeadlineExceededError, from_rpc_error
from kvrelay.client.health import HEALTH_TIMEOUT, health_request, is_serving
from kvrelay.client.options import DEFAULT_TARGET, ClientOptions, build_options
from kvrelay.client.retry import Deadline, RetryEvent, RetryHook, RetryPolicy
from kvrelay.client.types import ChatMessage, GenerateChunk, GenerateResult, Model
from kvrelay.v1 import generation_pb2 as pb
from kvrelay.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["Client", "Stream"]

T = TypeVar("T")


class Stream(Iterator[GenerateChunk]):
    """The chunks of one streamed call. Iterate it; `close()` (or leaving a `with` block, or
    breaking out early and closing) cancels the call on the server."""

    def __init__(self, call: Any, first: pb.GenerateResponse | None) -> None:
        self._call = call
        self._first = first
        self._done = first is None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> GenerateChunk:
        if self._first is not None:
            first, self._first = self._first, None
            return chunk_from_proto(first)
        if self._done:
            raise StopIteration
        try:
            response = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as exc:
            self._done = True
            raise from_rpc_error(exc) from None
        return chunk_from_proto(response)

    def close(self) -> None:
        """Cancel the call if it is still running (a no-op once it has finished)."""
        self._done = True
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Client:
    """Blocking client of `kvrelay.v1.Generation`.

    Args:
        target: "host:port" of the router's gRPC API.
        api_key: sent as `authorization: Bearer KEY`; default `$KVRELAY_API_KEY`.
        timeout: default deadline of each call in seconds (None: none); a call's own
            `timeout=` overrides it. The deadline spans all retries of the call.
        max_retries: re-sends after UNAVAILABLE / RESOURCE_EXHAUSTED (overrides the policy's).
        retry_policy: backoff settings; `on_retry` is called before each backoff sleep.
        credentials: TLS channel credentials; None is plaintext.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        max_retries: int | None = None,
        retry_policy: RetryPolicy | None = None,
        on_retry: RetryHook | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._options = build_options(
            target,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            retry_policy=retry_policy,
            on_retry=on_retry,
            credentials=credentials,
            channel_options=tuple(channel_options),
        )
        self._channel = _open_channel(self._options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        # Typed Any: the grpc_health stubs declare HealthStub without its Check method.
        self._health: Any = health_pb2_grpc.HealthStub(self._channel)

    @property
    def options(self) -> ClientOptions:
        return self._options

    # --- generation ------------------------------------------------------------------------

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = ...,
        stream: Literal[False] = ...,
        timeout: float | None = ...,
        request_id: str | None = ...,
        **sampling: Any,
    ) -> GenerateResult: ...

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = ...,
        stream: Literal[True],
        timeout: float | None = ...,
        request_id: str | None = ...,
        **sampling: Any,
    ) -> Stream: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        stream: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> GenerateResult | Stream:
        """Generate from a text prompt or token ids.

        `sampling` takes SamplingParams' names (temperature, top_p, max_tokens, stop, ...);
        any other keyword raises TypeError. With `stream=True` returns a `Stream` of
        `GenerateChunk`s once the first one has arrived; otherwise the whole `GenerateResult`.
        """
        request = build_request(
            prompt=prompt, model=model, stream=stream, request_id=request_id, sampling=sampling
        )
        return self._generate(request, timeout)

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any] | ChatMessage],
        *,
        model: str | None = ...,
        stream: Literal[False] = ...,
        timeout: float | None = ...,
        request_id: str | None = ...,
        **sampling: Any,
    ) -> GenerateResult: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any] | ChatMessage],
        *,
        model: str | None = ...,
        stream: Literal[True],
        timeout: float | None = ...,
        request_id: str | None = ...,
        **sampling: Any,
    ) -> Stream: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any] | ChatMessage],
        *,
        model: str | None = None,
        stream: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> GenerateResult | Stream:
        """Like `generate`, from chat messages rendered with the model's chat template."""
        request = build_request(
            messages=messages, model=model, stream=stream, request_id=request_id, sampling=sampling
        )
        return self._generate(request, timeout)

    def _generate(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> Stream | GenerateResult:
        metadata = self._options.metadata

        def attempt(remaining: float | None) -> Stream:
            call = self._stub.Generate(request, timeout=remaining, metadata=metadata)
            try:
                first = next(call)
            except StopIteration:
                first = None
            return Stream(call, first)

        stream = self._with_retries(attempt, self._options.deadline(timeout))
        if request.stream:
            return stream
        assembler = ResultAssembler()
        with stream:
            for chunk in stream:
                assembler.add(chunk)
        return assembler.result()

    # --- models and health -----------------------------------------------------------------

    def models(self, *, timeout: float | None = None) -> list[Model]:
        """The models the server serves."""
        response = self._with_retries(
            lambda remaining: self._stub.ListModels(
                pb.ListModelsRequest(), timeout=remaining, metadata=self._options.metadata
            ),
            self._options.deadline(timeout),
        )
        return [model_from_proto(m) for m in response.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """True when `grpc.health.v1` reports SERVING for `service` ("" is the whole server);
        False when it reports anything else or cannot be reached. Never retries."""
        try:
            response = self._health.Check(
                health_request(service),
                timeout=timeout or self._options.timeout or HEALTH_TIMEOUT,
                metadata=self._options.metadata,
            )
        except grpc.RpcError:
            return False
        return is_serving(response)

    # --- retries ---------------------------------------------------------------------------

    def _with_retries(self, attempt: Callable[[float | None], T], deadline: Deadline) -> T:
        """Run `attempt(remaining_seconds)` until it returns, re-running it after retryable
        errors as the policy allows. `attempt` must return as soon as the first response is in,
        so that anything after that point is outside this loop and never re-sent."""
        policy, hook = self._options.retry, self._options.on_retry
        number = 0
        while True:
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceededError(
                    "deadline passed before the call could be sent",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
            try:
                return attempt(remaining)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            delay = policy.delay_before_retry(number, error, deadline.remaining())
            if delay is None:
                raise error
            if hook is not None:
                hook(RetryEvent(attempt=number, error=error, delay=delay))
            time.sleep(delay)
            number += 1

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _open_channel(options: ClientOptions) -> grpc.Channel:
    channel_options = list(options.channel_options)
    if options.credentials is None:
        return grpc.insecure_channel(options.target, options=channel_options)
    return grpc.secure_channel(options.target, options.credentials, options=channel_options)
