"""TLS and API authentication. One real `kvrelay serve --colocated` for the module with TLS,
mTLS (--ssl-ca-certs) and an API key, so HTTPS, gRPC TLS and client certificates are checked
on one server; a test CA made here with the `openssl` CLI (no extra dependency). Cheap unit
checks (the Bearer rule, config and flag validation, the docs switch) need no server."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvrelay.api.auth import AuthenticationError, check_api_key
from kvrelay.api.http_app import create_http_app
from kvrelay.api.server import ServerConfig
from kvrelay.cli import _chat_streamer, build_parser
from kvrelay.cli_serve import _server_config, add_server_args
from kvrelay.client import AsyncClient, Client, UnavailableError
from kvrelay.client.options import build_options, tls_credentials
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.remote_chat import RemoteChat, https_context
from kvrelay.v1 import generation_pb2 as pb
from kvrelay.v1 import generation_pb2_grpc as pb_grpc
from tests.pki import make_ca as _make_ca
from tests.pki import make_expired as _make_expired
from tests.pki import make_leaf as _make_leaf
from tests.pki import openssl as _openssl
from tests.servers import ServerProcess, start_server

KEY = "tls-test-key"
BEARER = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca: the server's and the good client's CA; client / expired / stranger: a valid client
    certificate, an expired one from the same CA, and one from another CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the test certificates")
    folder = tmp_path_factory.mktemp("pki")
    _make_ca(folder, "ca")
    _make_ca(folder, "other-ca")
    _make_leaf(folder, "server", "ca", "serverAuth", san="IP:127.0.0.1,DNS:localhost")
    _make_leaf(folder, "client", "ca", "clientAuth")
    _make_leaf(folder, "stranger", "other-ca", "clientAuth")
    _make_expired(folder, "expired", "ca")
    # Each bad certificate is bad for its one reason: the expired one verifies when dates are
    # not checked, the stranger's against its own CA. (The HTTPS server only hangs up on them.)
    _openssl(folder, "verify", "-CAfile", "ca.pem", "-no_check_time", "expired.pem")
    _openssl(folder, "verify", "-CAfile", "other-ca.pem", "stranger.pem")
    for name in ("expired", "stranger"):
        with pytest.raises(subprocess.CalledProcessError):
            _openssl(folder, "verify", "-CAfile", "ca.pem", f"{name}.pem")
    return folder


def _https_context(pki: Path, who: str | None = "client") -> ssl.SSLContext:
    """Trusts the test CA; presents `who`'s certificate (None: none)."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if who is not None:
        context.load_cert_chain(pki / f"{who}.pem", pki / f"{who}.key")
    return context


def _grpc_credentials(pki: Path, who: str | None = "client") -> grpc.ChannelCredentials:
    if who is None:
        return tls_credentials(pki / "ca.pem")
    return tls_credentials(pki / "ca.pem", pki / f"{who}.pem", pki / f"{who}.key")


@pytest.fixture(scope="module")
def tls_server(
    default_model_dir: Path, pki: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("tls-server"),
        "--colocated",
        "--kv-cache-memory", "128MiB",
        "--ssl-certfile", str(pki / "server.pem"),
        "--ssl-keyfile", str(pki / "server.key"),
        "--ssl-ca-certs", str(pki / "ca.pem"),
        env={"KVRELAY_API_KEY": KEY},
        ssl_context=_https_context(pki),
    )  # fmt: skip
    yield server
    server.stop()


# --- over HTTPS ---------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_openai_client_over_https_with_a_client_certificate(
    tls_server: ServerProcess, pki: Path
) -> None:
    with httpx.Client(verify=_https_context(pki)) as http:
        client = openai.OpenAI(
            base_url=f"{tls_server.http_url}/v1", api_key=KEY, http_client=http, max_retries=0
        )
        reply = client.chat.completions.create(
            model=tls_server.model,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=0,
        )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    log = tls_server.log()  # the ready message names https and mTLS
    assert f"https://127.0.0.1:{tls_server.http_port}/v1" in log
    assert f"127.0.0.1:{tls_server.grpc_port} (mTLS)" in log


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("who", [None, "stranger", "expired"])
def test_https_refuses_clients_without_a_valid_certificate(
    tls_server: ServerProcess, pki: Path, who: str | None
) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{tls_server.http_url}/health", verify=_https_context(pki, who), timeout=10)
    with pytest.raises(httpx.TransportError):  # plaintext HTTP to the TLS port
        httpx.get(f"http://127.0.0.1:{tls_server.http_port}/health", timeout=10)


@pytest.mark.e2e
@pytest.mark.slow
def test_bearer_is_required_and_probes_stay_open(tls_server: ServerProcess, pki: Path) -> None:
    with httpx.Client(base_url=tls_server.http_url, verify=_https_context(pki)) as http:
        for header in (KEY, f"Basic {KEY}", f"Bearer {KEY}x", ""):
            reply = http.get("/v1/models", headers={"Authorization": header})
            assert reply.status_code == 401, header
            assert reply.json()["error"]["message"].startswith("invalid or missing API key")
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).is_success
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert http.get(path).status_code == 404, path


# --- over gRPC ----------------------------------------------------------------------------


def _health(target: str, credentials: grpc.ChannelCredentials) -> Any:
    with grpc.secure_channel(target, credentials) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=10)


@pytest.mark.e2e
@pytest.mark.slow
def test_grpc_tls_with_a_client_certificate(tls_server: ServerProcess, pki: Path) -> None:
    target = tls_server.grpc_target
    assert _health(target, _grpc_credentials(pki)).status == health_pb2.HealthCheckResponse.SERVING
    with grpc.secure_channel(target, _grpc_credentials(pki)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as bare:  # a key without "Bearer"
            stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=[("authorization", KEY)])
        assert bare.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=BEARER)
        assert [m.id for m in reply.models] == [tls_server.model]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("who", [None, "stranger", "expired"])
def test_grpc_refuses_clients_without_a_valid_certificate(
    tls_server: ServerProcess, pki: Path, who: str | None
) -> None:
    # Health needs no key: the handshake is the only thing that can refuse these calls.
    with pytest.raises(grpc.RpcError) as refused:
        _health(tls_server.grpc_target, _grpc_credentials(pki, who))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.e2e
@pytest.mark.slow
def test_grpc_refuses_plaintext_and_an_untrusted_server(tls_server: ServerProcess) -> None:
    with grpc.insecure_channel(tls_server.grpc_target) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as plaintext:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as untrusted:  # system roots do not know the test CA
        _health(tls_server.grpc_target, grpc.ssl_channel_credentials())
    assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.e2e
@pytest.mark.slow
def test_reflection_needs_the_key(tls_server: ServerProcess, pki: Path) -> None:
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.secure_channel(tls_server.grpc_target, _grpc_credentials(pki)) as channel:
        stub: Any = reflection_pb2_grpc.ServerReflectionStub(channel)
        for metadata in ((), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        [reply] = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=BEARER)
    names = {service.name for service in reply.list_services_response.service}
    assert "kvrelay.v1.Generation" in names


@pytest.mark.e2e
@pytest.mark.slow
def test_sdk_clients_over_mtls(tls_server: ServerProcess, pki: Path) -> None:
    files = {
        "ca_certs": pki / "ca.pem",
        "client_cert": pki / "client.pem",
        "client_key": pki / "client.key",
    }
    with Client(tls_server.grpc_target, api_key=KEY, timeout=120, **files) as client:
        result = client.generate("The capital of France is", max_tokens=3, temperature=0)
        assert result.usage.completion_tokens == 3

    async def async_models() -> list[str]:
        async with AsyncClient(tls_server.grpc_target, api_key=KEY, timeout=30, **files) as aio:
            return [m.id for m in await aio.models()]

    assert asyncio.run(async_models()) == [tls_server.model]
    no_cert = Client(
        tls_server.grpc_target, api_key=KEY, ca_certs=pki / "ca.pem", max_retries=0, timeout=10
    )
    with no_cert, pytest.raises(UnavailableError):
        no_cert.models()


@pytest.mark.e2e
@pytest.mark.slow
def test_kvrelay_chat_over_mtls(
    tls_server: ServerProcess, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_API_KEY", KEY)
    history = [{"role": "user", "content": "Say hi."}]
    ns = build_parser().parse_args(
        ["chat", "--url", tls_server.http_url, "--max-tokens", "4", "--temperature", "0",
         "--ca-certs", str(pki / "ca.pem"),
         "--client-cert", str(pki / "client.pem"), "--client-key", str(pki / "client.key")]
    )  # fmt: skip
    assert "".join(_chat_streamer(ns)(history))  # the CLI's own flags, end to end
    params = SamplingParams(temperature=0, max_tokens=4)
    no_cert = RemoteChat(
        tls_server.http_url, params, ssl_context=https_context(str(pki / "ca.pem"))
    )
    with pytest.raises(ValueError, match="cannot reach"):
        list(no_cert.stream(history))
    untrusted = RemoteChat(tls_server.http_url, params)  # the system's roots only
    with pytest.raises(ValueError, match="certificate verify failed"):
        list(untrusted.stream(history))


# --- without a server ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    ["secret", "Bearer", "Bearer ", "Basic secret", "Bearer  secret", "Bearer secret ", "",
     "Bearer secre", "Bearer secrets", "Bearersecret"],
)  # fmt: skip
def test_only_bearer_and_the_exact_key_pass(header: str) -> None:
    with pytest.raises(AuthenticationError):
        check_api_key(header, "secret", "Authorization: Bearer KEY")


def test_bearer_scheme_is_case_insensitive_and_no_key_lets_all_in() -> None:
    for header in ("Bearer secret", "bearer secret", "BEARER secret"):
        check_api_key(header, "secret", "Authorization: Bearer KEY")
    check_api_key("anything", None, "Authorization: Bearer KEY")


def test_docs_routes_only_when_enabled() -> None:
    # Only read while the routes are built (the admin routes keep the registry for later).
    router: Any = SimpleNamespace(tokenizer=None, registry=None)
    paths = ("/docs", "/redoc", "/openapi.json")
    with TestClient(create_http_app(router)) as off:
        assert [off.get(p).status_code for p in paths] == [404, 404, 404]
    with TestClient(create_http_app(router, enable_docs=True)) as on:
        assert [on.get(p).status_code for p in paths] == [200, 200, 200]


def test_tls_flags_reach_the_server_config(pki: Path) -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    files = [str(pki / name) for name in ("server.pem", "server.key", "ca.pem")]
    ns = parser.parse_args(
        ["--ssl-certfile", files[0], "--ssl-keyfile", files[1], "--ssl-ca-certs", files[2]]
    )
    config = _server_config(ns)
    assert (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs) == tuple(files)
    assert config.tls and config.mtls and not config.enable_docs
    assert _server_config(parser.parse_args(["--enable-docs"])).enable_docs
    with pytest.raises(SystemExit):  # a file that is not there fails at parse time
        parser.parse_args(["--ssl-certfile", str(pki / "missing.pem")])


def test_tls_settings_that_cannot_work_are_refused(pki: Path) -> None:
    with pytest.raises(ValueError, match="both"):
        ServerConfig(ssl_certfile=str(pki / "server.pem"))
    with pytest.raises(ValueError, match="needs --ssl-certfile"):
        ServerConfig(ssl_ca_certs=str(pki / "ca.pem"))
    with pytest.raises(ValueError, match="go together"):
        tls_credentials(pki / "ca.pem", client_cert=pki / "client.pem")
    with pytest.raises(ValueError, match="cannot read"):
        tls_credentials(pki / "missing.pem")
    with pytest.raises(ValueError, match="either credentials"):
        build_options(
            "127.0.0.1:1",
            api_key=None,
            timeout=None,
            max_retries=None,
            retry_policy=None,
            on_retry=None,
            credentials=grpc.ssl_channel_credentials(),
            channel_options=(),
            ca_certs=pki / "ca.pem",
        )


def test_chat_tls_files_that_cannot_work_are_refused(pki: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        https_context(client_cert=str(pki / "client.pem"))
    with pytest.raises(ValueError, match="cannot use the TLS files"):
        https_context(ca_certs=str(pki / "missing.pem"))
    with pytest.raises(ValueError, match="cannot use the TLS files"):  # a key that is not its
        https_context(None, str(pki / "client.pem"), str(pki / "stranger.key"))
    assert https_context(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
