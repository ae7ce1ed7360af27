"""Putting the platform together: workers (started here, or found on a Ray cluster), the
router over them, and both APIs, until a signal drains and stops it all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvrelay.api.server import ApiServer, ServerConfig
from kvrelay.config import RouterConfig
from kvrelay.engine.args import EngineArgs
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.workers import WorkerRegistry

logger = logging.getLogger(__name__)


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the router's process on uvloop where it is installed (asyncio's loop otherwise).

    At one stream every output token is a few loop wake-ups in the router (the channel's
    batch, the stream's queue, the SSE write); libuv's loop does each for less CPU than
    asyncio's pure-Python one, CPU the engine on the same cores gets back (vLLM's API server
    runs on uvloop for the same reason).
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def model_card(engine_args: EngineArgs, served_name: str | None) -> ModelCard:
    """The served model; its default name is the Hugging Face id, or the folder's name."""
    resolved = engine_args.resolve_model()
    engine_config = engine_args.create_engine_config(resolved.path)
    return ModelCard(served_name or resolved.name, engine_config.max_model_len, int(time.time()))


async def run_router(
    registry: WorkerRegistry,
    engine_args: EngineArgs,
    config: RouterConfig,
    server_config: ServerConfig,
    on_ready: Callable[[ApiServer, Router], None],
    background: list[Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Serve until SIGINT / SIGTERM, then drain."""
    from kvrelay.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine_args.resolve_model_path())
    card = model_card(engine_args, config.served_model_name)
    router = Router.create(registry, tokenizer, card, config)
    tasks = [asyncio.create_task(registry.run())]
    tasks += [asyncio.create_task(job) for job in background or []]
    server = ApiServer(router, server_config)
    try:
        await server.start()
        server.install_signal_handlers()
        on_ready(server, router)
        await server.wait_for_stop()
        await server.drain_and_stop()
    finally:
        router.encoder.close()
        router.relay.channels.close()  # the output channels: each aborts what it still runs
        await registry.close()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


def ready_message(server: ApiServer, router: Router, pools: str) -> str:
    cfg = server.config
    scheme = "https" if cfg.tls else "http"
    http = f"{scheme}://{cfg.http_host}:{server.http_port}"
    grpc_security = (" (mTLS)" if cfg.mtls else " (TLS)") if cfg.tls else ""
    auth = " -H 'Authorization: Bearer $KVRELAY_API_KEY'" if cfg.api_key else ""
    # With mTLS curl must present a certificate signed by --ssl-ca-certs; it must also trust
    # the server's CA (--cacert) when that is not a public one.
    cert = " --cert CLIENT.pem --key CLIENT.key" if cfg.mtls else ""
    body = (
        f'{{"model": "{router.model.id}", '
        '"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 40}'
    )
    return (
        f"kvrelay is serving {router.model.id} ({pools})\n"
        f"  OpenAI API  {http}/v1\n"
        f"  gRPC        {cfg.grpc_host}:{server.grpc_port}{grpc_security}\n"
        f"  metrics     {http}/metrics\n"
        "try:\n"
        f"  curl{cert} {http}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{body}'\n"
        "Ctrl-C stops it (requests in flight finish first)."
    )
