"""Both APIs in one asyncio loop beside the router, with a draining shutdown: on SIGTERM /
SIGINT new requests get 503 / UNAVAILABLE and health turns NOT_SERVING, in-flight streams
finish (up to a grace period), then the servers stop. TLS (and client certificates, mTLS) on
both APIs when ServerConfig names the files."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn

from kvrelay.api.body_limit import DEFAULT_MAX_BODY_BYTES
from kvrelay.api.grpc_service import NOT_SERVING, SERVICE_NAME, SERVING, add_services
from kvrelay.api.http_app import create_http_app
from kvrelay.router.router import Router
from kvrelay.router.tenant_limits import TenantBook

logger = logging.getLogger(__name__)
READINESS_POLL_S = 0.1


@dataclass(frozen=True)
class ServerConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # HTTP bodies and gRPC messages alike
    # PEM files. certfile + keyfile: both APIs speak TLS only. ca_certs: clients must present
    # a certificate signed by one of these CAs (mTLS), on HTTP and gRPC alike.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    enable_docs: bool = False  # /docs, /redoc, /openapi.json
    # Tenants (router/tenant_limits.py): the limits file (JSON / YAML, re-read on change), and
    # the header naming a request's tenant (default: its API key's tenant).
    tenant_limits: str | None = None
    tenant_header: str | None = None
    # A non-loopback address without authentication, accepted by --allow-unauthenticated
    # (the CLI refuses it otherwise): start() says so in one WARNING line.
    open_api: bool = False

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError(
                "--ssl-ca-certs (client certificates) needs --ssl-certfile and --ssl-keyfile: "
                "the server must speak TLS first"
            )

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def mtls(self) -> bool:
        return self.ssl_ca_certs is not None


def uvicorn_ssl_options(config: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config's ssl_* arguments: none without TLS; a client certificate required
    (CERT_REQUIRED) when ssl_ca_certs is set, so a client without one fails the handshake."""
    if not config.tls:
        return {}
    return {
        "ssl_certfile": config.ssl_certfile,
        "ssl_keyfile": config.ssl_keyfile,
        "ssl_ca_certs": config.ssl_ca_certs,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if config.mtls else ssl.CERT_NONE,
    }


def grpc_server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS credentials (None: plaintext); the files are read now, so a
    missing or unreadable one fails at start with its name."""
    if not config.tls:
        return None
    assert config.ssl_certfile is not None and config.ssl_keyfile is not None
    key, cert = _read(config.ssl_keyfile), _read(config.ssl_certfile)
    ca = _read(config.ssl_ca_certs) if config.ssl_ca_certs is not None else None
    return grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=ca is not None)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


class ApiServer:
    def __init__(self, router: Router, config: ServerConfig) -> None:
        self.router = router
        self.config = config
        self.http_port = config.http_port
        self.grpc_port = config.grpc_port
        options = [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", config.max_body_bytes),
        ]
        self._grpc = grpc.aio.server(options=options)
        self._grpc_credentials = grpc_server_credentials(config)
        if config.tenant_limits is not None or config.tenant_header is not None:
            router.tenants = TenantBook(
                config.tenant_limits, router.metrics.tenants, config.tenant_header
            )
        self._health: Any = add_services(self._grpc, router, config.api_key)
        app = create_http_app(
            router, config.api_key, config.max_body_bytes, enable_docs=config.enable_docs
        )
        uv_config = uvicorn.Config(
            app,
            host=config.http_host,
            port=config.http_port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            **uvicorn_ssl_options(config),
        )
        self._http = uvicorn.Server(uv_config)
        self._http_task: asyncio.Task[None] | None = None
        self._readiness: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        cfg = self.config
        address = f"{cfg.grpc_host}:{cfg.grpc_port}"
        if self._grpc_credentials is None:
            self.grpc_port = self._grpc.add_insecure_port(address)
        else:
            self.grpc_port = self._grpc.add_secure_port(address, self._grpc_credentials)
        await self._grpc.start()
        if cfg.open_api:
            logger.warning(
                "--allow-unauthenticated: HTTP on %s and gRPC on %s serve without an API key "
                "or client certificates; anyone who can reach them can use them",
                cfg.http_host,
                cfg.grpc_host,
            )
        self._readiness = asyncio.create_task(self._mirror_readiness())
        self._http_task = asyncio.create_task(self._http.serve())
        while not self._http.started:
            if self._http_task.done():
                await self._http_task  # raises why it could not start (port taken...)
                raise RuntimeError(f"the HTTP server did not start on port {cfg.http_port}")
            await asyncio.sleep(0.05)
        sockets = [s for server in self._http.servers for s in server.sockets]
        if sockets:
            self.http_port = sockets[0].getsockname()[1]

    async def _mirror_readiness(self) -> None:
        """gRPC health says what /health says, for the server ("") and for each service by
        name: SERVING exactly while the router is ready (a decode-capable worker is up and
        it is not draining), checked every READINESS_POLL_S."""
        last = None
        while True:
            status = SERVING if self.router.is_ready() else NOT_SERVING
            if status != last:
                for name in ("", SERVICE_NAME):
                    await self._health.set(name, status)
                last = status
            await asyncio.sleep(READINESS_POLL_S)

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def drain_and_stop(self) -> None:
        """Refuse new work, let in-flight requests finish, then stop both servers."""
        logger.warning("draining: %d requests in flight", self.router.num_active)
        self.router.start_draining()
        if self._readiness is not None:
            self._readiness.cancel()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, NOT_SERVING)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.router.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.router.num_active:
            logger.warning("stopping with %d requests still in flight", self.router.num_active)
        self._http.should_exit = True
        await self._grpc.stop(grace=2)
        if self._http_task is not None:
            await self._http_task
