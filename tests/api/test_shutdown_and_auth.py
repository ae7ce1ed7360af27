"""A server of its own (colocated, with an API key): the key is required on HTTP and gRPC, and
SIGTERM drains — streams in flight finish, new requests get 503, then the process exits."""

from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from kvrelay.v1 import generation_pb2 as pb
from kvrelay.v1 import generation_pb2_grpc as pb_grpc
from tests.servers import start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "s3cret-key"


def test_api_key_then_draining_shutdown(default_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tmp_path, "--colocated", env={"KVRELAY_API_KEY": KEY})
    try:
        base = f"{server.http_url}/v1"
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert refused.value.status_code == 401
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == [server.model]
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as unauthenticated:
                stub.ListModels(pb.ListModelsRequest(), timeout=10)
            assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.ListModels(
                pb.ListModelsRequest(), timeout=10, metadata=[("authorization", f"Bearer {KEY}")]
            )
            assert [m.id for m in reply.models] == [server.model]

        chunks: list[Any] = []
        first = threading.Event()

        def stream() -> None:
            for chunk in client.completions.create(
                model=server.model,
                prompt="A long tale:",
                max_tokens=48,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                chunks.append(chunk)
                first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(openai.APIStatusError) as draining:
            client.completions.create(model=server.model, prompt="Hi", max_tokens=2)
        assert draining.value.status_code == 503
        assert "shutting down" in draining.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{server.http_url}/health", timeout=5)
        assert health.value.code == 503
        reader.join(60)
        assert not reader.is_alive()
        text_chunks = [c for c in chunks if c.choices]
        assert text_chunks[-1].choices[0].finish_reason == "length"  # the stream finished whole
        assert server.process.wait(60) == 0
        assert "kvrelay: stopped" in server.log()
    finally:
        server.stop()
