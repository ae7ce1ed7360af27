"""`Client`: the blocking kvrelay SDK over a `grpc.Channel`.

Retries (see `retry.py`) happen only until a call's first response arrives; after that an error
ends the stream with a typed exception and nothing is re-sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import grpc

from kvrelay.client.base import Attempts, ClientBase, ClosingContext, StreamState
from kvrelay.client.convert import (
    ResultAssembler,
    build_request,
    chunk_from_proto,
    model_from_proto,
)
from kvrelay.client.errors import from_rpc_error
from kvrelay.client.health import health_request, is_serving
from kvrelay.client.options import ClientOptions
from kvrelay.client.types import ChatMessage, GenerateChunk, GenerateResult, Model
from kvrelay.v1 import generation_pb2 as pb

__all__ = ["Client", "Stream"]

T = TypeVar("T")


class Stream(StreamState, ClosingContext, Iterator[GenerateChunk]):
    """The chunks of one streamed call. Iterate it; `close()` (or leaving a `with` block, or
    breaking out early and closing) cancels the call on the server."""

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> GenerateChunk:
        first = self._take_first()
        if first is not None:
            return first
        if self._done:
            raise StopIteration
        try:
            response = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as exc:
            raise self._failed(exc) from None
        return chunk_from_proto(response)


class Client(ClientBase[grpc.Channel], ClosingContext):
    """Blocking client of `kvrelay.v1.Generation`.

    Args:
        target: "host:port" of the router's gRPC API.
        api_key: sent as `authorization: Bearer KEY`; default `$KVRELAY_API_KEY`.
        timeout: default deadline of each call in seconds (None: none); a call's own
            `timeout=` overrides it. The deadline spans all retries of the call.
        max_retries: re-sends after UNAVAILABLE / RESOURCE_EXHAUSTED (overrides the policy's).
        retry_policy: backoff settings; `on_retry` is called before each backoff sleep.
        credentials: TLS channel credentials; None is plaintext.
        ca_certs: PEM bundle to check the server's certificate against (a private CA); with
            it or the next two the channel is TLS, built by `tls_credentials` (instead of
            `credentials`). Without any: plaintext, unless `credentials` is given.
        client_cert, client_key: PEM certificate and key presented to a server that requires
            client certificates (`kvrelay serve --ssl-ca-certs`, mTLS).
    """

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
        priority: int = ...,
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
        priority: int = ...,
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
        priority: int = 0,
        **sampling: Any,
    ) -> GenerateResult | Stream:
        """Generate from a text prompt or token ids.

        `sampling` takes SamplingParams' names (temperature, top_p, max_tokens, stop, ...);
        any other keyword raises TypeError. With `stream=True` returns a `Stream` of
        `GenerateChunk`s once the first one has arrived; otherwise the whole `GenerateResult`.
        `priority` (vLLM's): lower runs first among this caller's (tenant's) waiting requests.
        """
        request = build_request(
            prompt=prompt,
            model=model,
            stream=stream,
            request_id=request_id,
            priority=priority,
            sampling=sampling,
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
        priority: int = ...,
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
        priority: int = ...,
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
        priority: int = 0,
        **sampling: Any,
    ) -> GenerateResult | Stream:
        """Like `generate`, from chat messages rendered with the model's chat template."""
        request = build_request(
            messages=messages,
            model=model,
            stream=stream,
            request_id=request_id,
            priority=priority,
            sampling=sampling,
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

        stream = self._with_retries(attempt, timeout)
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
            timeout,
        )
        return [model_from_proto(m) for m in response.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """True when `grpc.health.v1` reports SERVING for `service` ("" is the whole server);
        False when it reports anything else or cannot be reached. Never retries."""
        try:
            response = self._health.Check(
                health_request(service),
                timeout=self._health_timeout(timeout),
                metadata=self._options.metadata,
            )
        except grpc.RpcError:
            return False
        return is_serving(response)

    # --- retries ---------------------------------------------------------------------------

    def _with_retries(self, attempt: Callable[[float | None], T], timeout: float | None) -> T:
        """Run `attempt(remaining_seconds)` until it returns, re-running it after retryable
        errors as the policy allows. `attempt` must return as soon as the first response is in,
        so that anything after that point is outside this loop and never re-sent."""
        attempts = Attempts(self._options, timeout)
        while True:
            remaining = attempts.remaining()
            try:
                return attempt(remaining)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            time.sleep(attempts.backoff(error))

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def _open_channel(self, options: ClientOptions) -> grpc.Channel:
        channel_options = list(options.channel_options)
        if options.credentials is None:
            return grpc.insecure_channel(options.target, options=channel_options)
        return grpc.secure_channel(options.target, options.credentials, options=channel_options)
