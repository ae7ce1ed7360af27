"""kvrelay's Python SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the gRPC API.

from kvrelay.client import Client

with Client("127.0.0.1:50051") as client:
    print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
"""

from __future__ import annotations

from kvrelay.client import errors, types
from kvrelay.client.async_client import AsyncClient, AsyncStream
from kvrelay.client.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    KVRelayError,
    NotFoundError,
    OverloadedError,
    RequestCancelledError,
    UnavailableError,
)
from kvrelay.client.options import tls_credentials
from kvrelay.client.retry import RetryEvent, RetryPolicy
from kvrelay.client.sync_client import Client, Stream
from kvrelay.client.types import (
    ChatMessage,
    Choice,
    ChoiceDelta,
    GenerateChunk,
    GenerateResult,
    Model,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvrelay.common.structured_outputs import StructuredOutputs

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "ChatMessage",
    "Choice",
    "ChoiceDelta",
    "Client",
    "DeadlineExceededError",
    "GenerateChunk",
    "GenerateResult",
    "InternalError",
    "InvalidArgumentError",
    "KVRelayError",
    "Model",
    "NotFoundError",
    "OverloadedError",
    "RequestCancelledError",
    "RetryEvent",
    "RetryPolicy",
    "Stream",
    "StructuredOutputs",
    "TokenLogprob",
    "TopLogprob",
    "UnavailableError",
    "Usage",
    "errors",
    "tls_credentials",
    "types",
]
