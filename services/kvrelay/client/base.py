"""What `Client` and `AsyncClient` share: construction and stubs, the streams' bookkeeping, and
the retry decisions of one call. Nothing here blocks or awaits: the two clients do their own
I/O and sleeping, each in its own way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvrelay.client.convert import chunk_from_proto
from kvrelay.client.errors import DeadlineExceededError, KVRelayError, from_rpc_error
from kvrelay.client.health import HEALTH_TIMEOUT
from kvrelay.client.options import DEFAULT_TARGET, ClientOptions, build_options
from kvrelay.client.retry import RetryEvent, RetryHook, RetryPolicy
from kvrelay.client.types import GenerateChunk
from kvrelay.v1 import generation_pb2 as pb
from kvrelay.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["Attempts", "ClientBase", "ClosingContext", "StreamState"]

ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)
SelfT = TypeVar("SelfT", bound="ClosingContext")


class ClosingContext:
    """`with obj:` closes `obj` on leaving the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: SelfT) -> SelfT:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ClientBase(Generic[ChannelT]):
    """The options, channel and stubs of a client; subclasses open the channel."""

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
        ca_certs: str | os.PathLike[str] | None = None,
        client_cert: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
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
            ca_certs=ca_certs,
            client_cert=client_cert,
            client_key=client_key,
        )
        self._channel: ChannelT = self._open_channel(self._options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        # Typed Any: the grpc_health stubs declare HealthStub without its Check method.
        self._health: Any = health_pb2_grpc.HealthStub(self._channel)

    def _open_channel(self, options: ClientOptions) -> ChannelT:
        raise NotImplementedError

    @property
    def options(self) -> ClientOptions:
        return self._options

    def _health_timeout(self, timeout: float | None) -> float:
        """A probe's deadline: its own, else the client's, else HEALTH_TIMEOUT (never none)."""
        return timeout or self._options.timeout or HEALTH_TIMEOUT


class StreamState:
    """The call of one streamed generation and the first response, already read (the retry
    loop waits for it), which the stream hands out before reading any more."""

    def __init__(self, call: Any, first: pb.GenerateResponse | None) -> None:
        self._call = call
        self._first = first
        self._done = first is None

    def _take_first(self) -> GenerateChunk | None:
        """The first chunk on the first call; None afterwards."""
        if self._first is None:
            return None
        first, self._first = self._first, None
        return chunk_from_proto(first)

    def _failed(self, exc: grpc.RpcError) -> KVRelayError:
        """The stream ended with `exc`: nothing more is read; returns the typed error."""
        self._done = True
        return from_rpc_error(exc)

    def close(self) -> None:
        """Cancel the call if it is still running (a no-op once it has finished)."""
        self._done = True
        self._call.cancel()


class Attempts:
    """The attempts of one call: how long the next may take, and whether and when a failed
    one is sent again. One deadline spans them all."""

    def __init__(self, options: ClientOptions, timeout: float | None) -> None:
        self._deadline = options.deadline(timeout)
        self._policy = options.retry
        self._hook = options.on_retry
        self._number = 0

    def remaining(self) -> float | None:
        """Seconds the next attempt may take (None: no deadline).

        Raises:
            DeadlineExceededError: the deadline has already passed.
        """
        remaining = self._deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceededError(
                "deadline passed before the call could be sent",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        return remaining

    def backoff(self, error: KVRelayError) -> float:
        """Seconds to wait before sending again after `error`, told to the `on_retry` hook.

        Raises:
            KVRelayError: `error` itself, when the call must fail now (not retryable, retries
                spent, or the wait would outlast the deadline).
        """
        delay = self._policy.delay_before_retry(self._number, error, self._deadline.remaining())
        if delay is None:
            raise error
        if self._hook is not None:
            self._hook(RetryEvent(attempt=self._number, error=error, delay=delay))
        self._number += 1
        return delay
