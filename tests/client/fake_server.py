"""A scripted in-process `kvrelay.v1.Generation` server for the retry / error unit tests.

Only for failures that the real server cannot be made to produce on demand (UNAVAILABLE twice,
then success). Integration tests use the real server (`kvrelay_server`), never this.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvrelay.v1 import generation_pb2 as pb
from kvrelay.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Fail:
    """Abort the call with `code` after sending `after` responses."""

    code: grpc.StatusCode
    details: str = "scripted failure"
    after: int = 0
    trailing: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Answer:
    """Stream these text pieces, one response each, then finish."""

    pieces: Sequence[str] = ("Hello", ",", " world")


def responses(request_id: str, pieces: Sequence[str]) -> list[pb.GenerateResponse]:
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(
            pb.GenerateResponse(
                request_id=request_id,
                choices=[
                    pb.Choice(
                        index=0,
                        token_ids=[100 + i],
                        text=piece,
                        finish_reason=pb.FINISH_REASON_LENGTH if last else 0,
                    )
                ],
                usage=pb.Usage(
                    prompt_tokens=3, completion_tokens=len(pieces), total_tokens=3 + len(pieces)
                )
                if last
                else None,
            )
        )
    return out


@dataclass
class Script(pb_grpc.GenerationServicer):
    """Attempt k follows `steps[k]` (the last step repeats); records every request and the
    metadata it came with."""

    steps: list[Fail | Answer]
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _step(self, request: object, context: grpc.ServicerContext) -> Fail | Answer:
        with self.lock:
            self.requests.append(request)  # type: ignore[arg-type]
            self.metadata.append({k: v for k, v in context.invocation_metadata()})
            return self.steps[min(len(self.requests) - 1, len(self.steps) - 1)]

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        step = self._step(request, context)
        pieces = step.pieces if isinstance(step, Answer) else ["tok"] * (step.after + 1)
        rid = request.request_id or "fake-1"
        for i, response in enumerate(responses(rid, pieces)):
            if isinstance(step, Fail) and i == step.after:
                break
            yield response
        if isinstance(step, Fail):
            context.set_trailing_metadata(step.trailing)
            context.abort(step.code, step.details)

    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        step = self._step(request, context)
        if isinstance(step, Fail):
            context.set_trailing_metadata(step.trailing)
            context.abort(step.code, step.details)
        return pb.ListModelsResponse(
            models=[pb.Model(id="fake-model", max_model_len=2048, created=1, owned_by="kvrelay")]
        )


class FakeServer:
    """`with FakeServer([...]) as server:` serves the script on a free loopback port."""

    def __init__(self, steps: list[Fail | Answer]) -> None:
        self.script = Script(steps)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_GenerationServicer_to_server(self.script, self._server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{port}"

    @property
    def attempts(self) -> int:
        return len(self.script.requests)

    def __enter__(self) -> FakeServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
