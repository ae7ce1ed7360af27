"""`AsyncClient`: the asyncio kvrelay SDK over a `grpc.aio.Channel`.

Same contract as `Client` (see `sync_client.py`): retries only before a call's first response.
Create it inside the event loop that uses it (grpc.aio channels are bound to one loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import grpc

from kvrelay.client.base import Attempts, ClientBase, StreamState
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

__all__ = ["AsyncClient", "AsyncStream"]

T = TypeVar("T")


class AsyncStream(StreamState, AsyncIterator[GenerateChunk]):
    """The chunks of one streamed call. `async for` over it; `close()` (or leaving an
    `async with` block) cancels the call on the server."""

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        first = self._take_first()
        if first is not None:
            return first
        if self._done:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except grpc.RpcError as exc:
            raise self._failed(exc) from None
        if response is grpc.aio.EOF:
            self._done = True
            raise StopAsyncIteration
        return chunk_from_proto(response)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient(ClientBase[grpc.aio.Channel]):
    """asyncio client of `kvrelay.v1.Generation`; arguments as `kvrelay.client.Client`."""

    # --- generation ------------------------------------------------------------------------

    @overload
    async def generate(
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
    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = ...,
        stream: Literal[True],
        timeout: float | None = ...,
        request_id: str | None = ...,
        priority: int = ...,
        **sampling: Any,
    ) -> AsyncStream: ...

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        stream: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        **sampling: Any,
    ) -> GenerateResult | AsyncStream:
        """As `Client.generate`; `stream=True` returns an `AsyncStream` once the first chunk
        has arrived (`async for chunk in await client.generate(..., stream=True)`)."""
        request = build_request(
            prompt=prompt,
            model=model,
            stream=stream,
            request_id=request_id,
            priority=priority,
            sampling=sampling,
        )
        return await self._generate(request, timeout)

    @overload
    async def chat(
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
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any] | ChatMessage],
        *,
        model: str | None = ...,
        stream: Literal[True],
        timeout: float | None = ...,
        request_id: str | None = ...,
        priority: int = ...,
        **sampling: Any,
    ) -> AsyncStream: ...

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any] | ChatMessage],
        *,
        model: str | None = None,
        stream: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        **sampling: Any,
    ) -> GenerateResult | AsyncStream:
        """As `Client.chat`."""
        request = build_request(
            messages=messages,
            model=model,
            stream=stream,
            request_id=request_id,
            priority=priority,
            sampling=sampling,
        )
        return await self._generate(request, timeout)

    async def _generate(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> GenerateResult | AsyncStream:
        metadata = self._options.metadata

        async def attempt(remaining: float | None) -> AsyncStream:
            call = self._stub.Generate(request, timeout=remaining, metadata=metadata)
            try:
                first = await call.read()
            except BaseException:
                call.cancel()  # e.g. our task was cancelled: do not leave the RPC running
                raise
            return AsyncStream(call, None if first is grpc.aio.EOF else first)

        stream = await self._with_retries(attempt, timeout)
        if request.stream:
            return stream
        assembler = ResultAssembler()
        async with stream:
            async for chunk in stream:
                assembler.add(chunk)
        return assembler.result()

    # --- models and health -----------------------------------------------------------------

    async def models(self, *, timeout: float | None = None) -> list[Model]:
        """The models the server serves."""

        async def attempt(remaining: float | None) -> pb.ListModelsResponse:
            response: pb.ListModelsResponse = await self._stub.ListModels(
                pb.ListModelsRequest(), timeout=remaining, metadata=self._options.metadata
            )
            return response

        response = await self._with_retries(attempt, timeout)
        return [model_from_proto(m) for m in response.models]

    async def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """As `Client.health`."""
        try:
            response = await self._health.Check(
                health_request(service),
                timeout=self._health_timeout(timeout),
                metadata=self._options.metadata,
            )
        except grpc.RpcError:
            return False
        return is_serving(response)

    # --- retries ---------------------------------------------------------------------------

    async def _with_retries(
        self, attempt: Callable[[float | None], Awaitable[T]], timeout: float | None
    ) -> T:
        """As `Client._with_retries`, sleeping without blocking the loop."""
        attempts = Attempts(self._options, timeout)
        while True:
            remaining = attempts.remaining()
            try:
                return await attempt(remaining)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            await asyncio.sleep(attempts.backoff(error))

    # --- lifetime --------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _open_channel(self, options: ClientOptions) -> grpc.aio.Channel:
        channel_options = list(options.channel_options)
        if options.credentials is None:
            return grpc.aio.insecure_channel(options.target, options=channel_options)
        return grpc.aio.secure_channel(options.target, options.credentials, options=channel_options)
