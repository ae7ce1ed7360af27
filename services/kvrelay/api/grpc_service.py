"""The gRPC API: kvrelay.v1.Generation, grpc.health.v1 and server reflection."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvrelay.api.auth import request_tenant
from kvrelay.api.grpc_convert import response_message, to_request
from kvrelay.router.request_errors import InvalidRequestError, OverloadedError, RouterError
from kvrelay.router.router import Router
from kvrelay.router.types import collect_chunks
from kvrelay.v1 import generation_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FAILED = "the server failed this request; it has been logged"
logger = logging.getLogger(__name__)


class GenerationService:
    """kvrelay.v1.Generation. Requests arrive as bytes and are parsed here, so a malformed
    message is INVALID_ARGUMENT (gRPC's own deserializer would answer INTERNAL)."""

    def __init__(self, router: Router, api_key: str | None = None) -> None:
        self.router = router
        self.api_key = api_key

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            tenant = self._tenant(context)
            request = _parse(pb.GenerateRequest, raw)
            greq = await to_request(request, self.router, context.time_remaining(), tenant)
            await self.router.check_output_constraint(greq)
            ticket = self.router.admit(greq)
            top_k = greq.params.logprobs or 0
            chunks = self.router.generate(greq, ticket)
            tokenizer, label = self.router.tokenizer, greq.label
            if request.stream:
                async for chunk in chunks:
                    yield response_message(chunk, tokenizer, top_k, label)
            else:
                whole = await collect_chunks(chunks, greq.request_id)
                yield response_message(whole, tokenizer, top_k, label)
        except RouterError as exc:
            await _abort(context, exc)
        except Exception:  # never UNKNOWN with a traceback's text: log it, say nothing inside
            logger.exception("gRPC Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, _FAILED)

    async def ListModels(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._authenticate(context)
            _parse(pb.ListModelsRequest, raw)
        except RouterError as exc:
            await _abort(context, exc)
        card = self.router.model
        model = pb.Model(
            id=card.id, max_model_len=card.max_model_len, created=card.created, owned_by="kvrelay"
        )
        return pb.ListModelsResponse(models=[model])

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        self._tenant(context)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """Authenticate (the operator's key or a tenant's) and name the caller's tenant."""
        metadata = dict(context.invocation_metadata() or ())
        authorization = str(metadata.get("authorization", ""))
        book = self.router.tenants
        header = book.tenant_header
        value = str(metadata[header]) if header is not None and header in metadata else None
        how = "authorization: Bearer KEY"
        return request_tenant(book, self.api_key, authorization, value, how)

    def add_to(self, server: grpc.aio.Server) -> None:
        handlers: dict[str, Any] = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=pb.GenerateResponse.SerializeToString
            ),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.ListModels, response_serializer=pb.ListModelsResponse.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )


def _parse(message_type: Any, raw: bytes) -> Any:
    try:
        return message_type.FromString(raw)
    except DecodeError:
        name = message_type.DESCRIPTOR.full_name
        raise InvalidRequestError(f"the request is not a valid {name} message") from None


async def _abort(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    if isinstance(exc, OverloadedError):
        context.set_trailing_metadata((("retry-after", str(max(1, math.ceil(exc.retry_after_s)))),))
    code = grpc.StatusCode[exc.status.grpc_name]
    # Details start with the field at fault, as a client matching on them expects.
    named = exc.param is None or exc.message.startswith(exc.param)
    message = exc.message if named else f"{exc.param}: {exc.message}"
    await context.abort(code, message)


class KeyedReflection(reflection_pb2_grpc.ServerReflectionServicer):
    """Server reflection that, with an API key set, answers only callers sending it (the
    service list maps the API, as /openapi.json would).

    Why a wrapper and not a server interceptor: the check stays in the one handler it
    concerns, and a grpc.aio interceptor could refuse a bidi-streaming call only by building a
    replacement handler. Health stays open: probes carry no key."""

    def __init__(
        self,
        service_names: tuple[str, ...],
        authenticate: Callable[[grpc.aio.ServicerContext], None],
    ) -> None:
        # Typed Any: the stubs declare ServerReflectionInfo a coroutine; it is an async generator.
        self._reflection: Any = reflection.aio.ReflectionServicer(service_names)
        self._authenticate = authenticate

    async def ServerReflectionInfo(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            self._authenticate(context)
        except RouterError as exc:
            await _abort(context, exc)
        async for response in self._reflection.ServerReflectionInfo(request_iterator, context):
            yield response


def add_services(server: grpc.aio.Server, router: Router, api_key: str | None) -> Any:
    """Register the Generation, health and reflection services; returns the health servicer
    (the server flips it to NOT_SERVING while draining)."""
    generation = GenerationService(router, api_key)
    generation.add_to(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflecting = KeyedReflection((*names, reflection.SERVICE_NAME), generation._authenticate)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflecting, server)
    return health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
