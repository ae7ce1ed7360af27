"""Both APIs in one asyncio loop beside the router, with a draining shutdown: on SIGTERM /
SIGINT new requests get 503 / UNAVAILABLE and health turns NOT_SERVING, in-flight streams
finish (up to a grace period), then the servers stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn

from kvrelay.api.body_limit import DEFAULT_MAX_BODY_BYTES
from kvrelay.api.grpc_service import NOT_SERVING, SERVING, add_services
from kvrelay.api.http_app import create_http_app
from kvrelay.router.router import Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # HTTP bodies and gRPC messages alike


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
        self._health: Any = add_services(self._grpc, router, config.api_key)
        app = create_http_app(router, config.api_key, config.max_body_bytes)
        uv_config = uvicorn.Config(
            app,
            host=config.http_host,
            port=config.http_port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        self._http = uvicorn.Server(uv_config)
        self._http_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        cfg = self.config
        self.grpc_port = self._grpc.add_insecure_port(f"{cfg.grpc_host}:{cfg.grpc_port}")
        await self._grpc.start()
        await self._health.set("", SERVING)
        self._http_task = asyncio.create_task(self._http.serve())
        while not self._http.started:
            if self._http_task.done():
                await self._http_task  # raises why it could not start (port taken...)
                raise RuntimeError(f"the HTTP server did not start on port {cfg.http_port}")
            await asyncio.sleep(0.05)
        sockets = [s for server in self._http.servers for s in server.sockets]
        if sockets:
            self.http_port = sockets[0].getsockname()[1]

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
        await self._health.set("", NOT_SERVING)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.router.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.router.num_active:
            logger.warning("stopping with %d requests still in flight", self.router.num_active)
        self._http.should_exit = True
        await self._grpc.stop(grace=2)
        if self._http_task is not None:
            await self._http_task
