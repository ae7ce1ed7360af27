"""`kvrelay serve`, `kvrelay router` and `kvrelay worker`: the serving entry points.

`serve` is the embedded default (a local Ray cluster, one prefill and one decode worker, the
router and both APIs in this process). `router` and `worker` are its two halves for
multi-node and Kubernetes deployments: workers join a Ray cluster as named actors, a router
finds them (or, with --manage-workers, starts one per `kvrelay_<role>` resource unit).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from kvrelay.cli_flags import (
    check_open_api,
    header_name,
    int_at_least,
    non_empty,
    port,
    readable_file,
    seconds,
    size,
    tenant_limits_file,
)
from kvrelay.common.env import API_KEY
from kvrelay.config import RouterConfig
from kvrelay.engine.args import KV_TRANSFER_FAILURES, EngineArgs, flag_type
from kvrelay.worker.ray_cluster import DEFAULT_JOIN_TIMEOUT_S, join_ray_cluster

SERVE_EPILOG = """\
examples:
  kvrelay serve                                the default model, 1 prefill + 1 decode worker
  kvrelay serve --colocated                    one worker doing both (the baseline)
  kvrelay serve --model ~/models/Llama-3.2-1B --num-decode 2 --http-port 9000
  KVRELAY_API_KEY=secret kvrelay serve         require 'Authorization: Bearer secret'
"""


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("APIs")
    add = group.add_argument
    add("--http-host", type=non_empty, default="127.0.0.1",
        help="OpenAI HTTP API address (default 127.0.0.1)")  # fmt: skip
    add("--http-port", type=port, default=8000, help="OpenAI HTTP API port (default 8000)")
    add("--grpc-host", type=non_empty, default="127.0.0.1",
        help="gRPC API address (default 127.0.0.1)")  # fmt: skip
    add("--grpc-port", type=port, default=50051, help="gRPC API port (default 50051)")
    add(
        "--api-key",
        default=None,
        help="the API key clients must send, exactly 'Authorization: Bearer KEY' on HTTP and "
        "gRPC (gRPC reflection too); /health, /metrics and gRPC health stay open for probes "
        "and Prometheus. Prefer --api-key-env, which keeps it out of the process list",
    )
    add(
        "--api-key-env",
        type=non_empty,
        default=API_KEY.name,
        help="environment variable holding the API key clients must send; unset or empty "
        "means no key (default KVRELAY_API_KEY)",
    )
    add("--allow-unauthenticated", action="store_true", help="serve on a non-loopback "
        "--http-host/--grpc-host without an API key or client certificates (refused "
        "otherwise): anyone who can reach the ports can use the APIs")  # fmt: skip
    add("--drain-timeout", type=seconds(zero=True), default=30.0,
        help="seconds in-flight requests get to finish on shutdown (default 30)")  # fmt: skip
    add(
        "--max-body-bytes",
        type=size,
        default=4 * 1024 * 1024,
        help="largest HTTP request body / gRPC message, e.g. 4194304 or 4MiB; larger ones get "
        "413 / RESOURCE_EXHAUSTED (default 4 MiB)",
    )
    _add_tls_args(group)
    _add_router_args(parser)


def _add_router_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("router")
    add = group.add_argument
    add("--served-model-name", type=non_empty, default=None, help="model id clients use "
        "(default: the Hugging Face id, or the model folder's name)")  # fmt: skip
    add("--max-in-flight", type=int_at_least(1), default=256,
        help="sequences running at once: a request counts as its n (per prompt), and one "
        "that could never fit is refused with a 400 naming n (default 256)")  # fmt: skip
    # Its dest is RouterConfig's name for it: the one place the flag's spelling is mapped.
    add("--migration-timeout", dest="migration_wait_s", type=seconds(zero=True), default=60.0,
        help="seconds "
        "a stream whose worker died waits for another to resume it at (a replacement starting), "
        "then fails with 503 (default 60)")  # fmt: skip
    add("--max-n", type=int_at_least(1), default=128,
        help="most samples (n) one request may ask for (default 128)")  # fmt: skip
    add(
        "--max-queued",
        type=int_at_least(0),
        default=512,
        help="sequences waiting beyond --max-in-flight, served fairly across tenants; more "
        "get 429 (default 512)",
    )
    _add_tenant_args(group)
    add(
        "--routing-policy",
        choices=["score", "round_robin"],
        default="score",
        help="score: prefix-cache overlap, queue depth and KV usage, weighted (default)",
    )
    add(
        "--max-local-prefill-tokens",
        type=int_at_least(0),
        default=64,
        help="prompts with at most this many tokens not cached at the decode worker run "
        "whole there, without a prefill worker (default 64)",
    )


def _add_tenant_args(group: Any) -> None:
    add = group.add_argument
    add(
        "--tenant-limits",
        type=tenant_limits_file,
        default=None,
        metavar="FILE",
        help="tenants' API keys, weights and limits (requests/tokens per minute, concurrent "
        "sequences), JSON or YAML; re-read when it changes; see docs/operations.md "
        "'Tenants and limits' (default: one tenant, no limits)",
    )
    add(
        "--tenant-header",
        type=header_name,
        default=None,
        metavar="NAME",
        help="request header naming the tenant (e.g. X-Tenant, set by a gateway) for fair "
        "queueing and limits; without it (or the flag) the API key's tenant",
    )


def _add_tls_args(group: Any) -> None:
    add = group.add_argument
    add(
        "--ssl-certfile",
        type=readable_file,
        default=None,
        metavar="PEM",
        help="server certificate (chain); with --ssl-keyfile both APIs speak TLS only: "
        "https:// and a TLS gRPC port (default: plaintext)",
    )
    add("--ssl-keyfile", type=readable_file, default=None, metavar="PEM",
        help="private key of --ssl-certfile")  # fmt: skip
    add(
        "--ssl-ca-certs",
        type=readable_file,
        default=None,
        metavar="PEM",
        help="CA bundle for client certificates (mTLS): HTTP and gRPC clients without a "
        "valid certificate signed by one of these CAs fail the handshake (setting it "
        "requires them; there is no --ssl-cert-reqs)",
    )
    add(
        "--enable-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (off by default: they map the API for "
        "anyone who can connect, with or without a key)",
    )


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workers")
    add = group.add_argument
    add(
        "--transfer-backend",
        choices=["auto", "nixl", "grpc"],
        default="auto",
        help="KV relay between workers: NIXL (UCX) when installed, else gRPC (default auto)",
    )
    add("--kv-lease-seconds", type=flag_type("kv_lease_seconds", float), default=30.0,
        help="how long a prefill worker holds a handed-off prompt's KV for its decode worker "
        "(default 30)")  # fmt: skip
    add(
        "--kv-transfer-failure",
        choices=KV_TRANSFER_FAILURES,
        default="recompute",
        help="when a KV pull fails: recompute the prompt at the decode worker, or fail",
    )
    add("--worker-threads", type=int_at_least(1), default=None,
        help="torch threads per worker (default: the machine's cores shared among the "
        "workers)")  # fmt: skip
    add(
        "--kv-secret-file",
        type=readable_file,
        default=None,
        metavar="PATH",
        help="file holding the secret every KV pull between workers is authenticated with "
        "(e.g. a mounted Kubernetes Secret; the same for all workers of a deployment). "
        "Default: $KVRELAY_KV_SECRET or $KVRELAY_KV_SECRET_FILE; `serve` makes a random one "
        "when none is set. A router's --manage-workers workers read their node's environment",
    )


def build_serve_parsers(commands: Any) -> None:
    """`serve`, `router`, `worker` and `operator`, each flag checked as it is parsed and the
    rules between flags by its `check_flags`, before anything starts."""
    _add_serve_parser(commands)
    _add_router_parser(commands)
    _add_worker_parser(commands)
    _add_operator_parser(commands)


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="start the whole platform locally: Ray, workers, router, APIs",
        description="Start a local Ray cluster with prefill and decode workers, the router, "
        "the OpenAI HTTP API and the gRPC API; Ctrl-C drains and stops.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    EngineArgs.add_cli_args(serve)
    add_pool_args(serve)
    serve.add_argument("--num-prefill", type=int_at_least(1), default=None,
                       help="prefill workers (default 1; none with --colocated)")  # fmt: skip
    serve.add_argument("--num-decode", type=int_at_least(1), default=1,
                       help="decode workers (default 1)")  # fmt: skip
    serve.add_argument(
        "--colocated", action="store_true", help="--num-decode workers doing both, no relay"
    )
    serve.add_argument("--ray-address", type=non_empty, default=None,
                       help="join this Ray cluster instead")  # fmt: skip
    add_server_args(serve)
    serve.set_defaults(check_flags=_check_serve, command_parser=serve)


def _add_router_parser(commands: Any) -> None:
    router = commands.add_parser(
        "router",
        help="run the router and APIs over workers on a Ray cluster",
        description="Join a Ray cluster and route to the kvrelay workers on it (started by "
        "`kvrelay worker`, or by this router with --manage-workers).",
    )
    EngineArgs.add_cli_args(router)
    add_pool_args(router)
    router.add_argument("--ray-address", type=non_empty, required=True,
                        help="e.g. auto or ray://HEAD:10001")  # fmt: skip
    _add_join_timeout(router)
    router.add_argument(
        "--manage-workers",
        action="store_true",
        help="keep one worker per unit of the Ray resources kvrelay_prefill / kvrelay_decode",
    )
    add_server_args(router)
    router.set_defaults(check_flags=_check_serving, command_parser=router)


def _add_worker_parser(commands: Any) -> None:
    worker = commands.add_parser(
        "worker",
        help="start one worker on this Ray node and keep it until stopped",
        description="Start a named kvrelay worker actor on this node of a Ray cluster; a "
        "router on the cluster finds it. Ctrl-C / SIGTERM stops it.",
    )
    EngineArgs.add_cli_args(worker)
    add_pool_args(worker)
    worker.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    worker.add_argument("--ray-address", type=non_empty, default="auto",
                        help="the Ray cluster (default auto)")  # fmt: skip
    _add_join_timeout(worker)
    worker.set_defaults(check_flags=_check_worker, command_parser=worker)


def _add_operator_parser(commands: Any) -> None:
    operator = commands.add_parser(
        "operator",
        help="run the Kubernetes operator (KVRelayService -> RayCluster, router, pools)",
        description="Reconcile KVRelayService resources into running deployments and scale "
        "their pools toward their SLO targets. Runs in the cluster (see deploy/helm/kvrelay).",
    )
    from kvrelay_operator.app import add_operator_arguments

    add_operator_arguments(operator)


def _add_join_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray-join-timeout",
        type=seconds(zero=False),
        default=DEFAULT_JOIN_TIMEOUT_S,
        metavar="SECONDS",
        help="how long to wait for the Ray cluster to come up (default "
        f"{DEFAULT_JOIN_TIMEOUT_S:.0f}; on Kubernetes the head may start after this pod)",
    )


def _check_worker(ns: argparse.Namespace) -> None:
    """The rules between a worker's flags (each flag's own are checked as it is parsed)."""
    from kvrelay.cli import check_engine_flags

    check_engine_flags(ns, _engine_args)


def _check_serving(ns: argparse.Namespace) -> None:
    """A router's (and `serve`'s): the engine's rules, the TLS flags' pairs and no API open
    off loopback without --allow-unauthenticated."""
    _check_worker(ns)
    _server_config(ns)


def _check_serve(ns: argparse.Namespace) -> None:
    _check_serving(ns)
    if ns.colocated and ns.num_prefill is not None:
        raise ValueError(
            "argument --num-prefill: --colocated runs no prefill workers (--num-decode "
            "workers do both): drop one of them"
        )


def cmd_operator(ns: argparse.Namespace) -> int:
    from kvrelay_operator.app import run_operator

    return run_operator(ns)


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    args = EngineArgs.from_cli_args(ns)
    return dataclasses.replace(
        args, kv_lease_seconds=ns.kv_lease_seconds, kv_transfer_failure=ns.kv_transfer_failure
    )


def _server_config(ns: argparse.Namespace) -> Any:
    api_key = ns.api_key or os.environ.get(ns.api_key_env) or None
    open_api = check_open_api(ns, api_key)  # refused before the server's modules load Ray's
    from kvrelay.api.server import ServerConfig

    return ServerConfig(
        ns.http_host,
        ns.http_port,
        ns.grpc_host,
        ns.grpc_port,
        api_key,
        ns.drain_timeout,
        ns.max_body_bytes,
        ssl_certfile=ns.ssl_certfile,
        ssl_keyfile=ns.ssl_keyfile,
        ssl_ca_certs=ns.ssl_ca_certs,
        enable_docs=ns.enable_docs,
        tenant_limits=ns.tenant_limits,
        tenant_header=ns.tenant_header,
        open_api=open_api,
    )


def _router_config(ns: argparse.Namespace) -> RouterConfig:
    """The router's options from the flags (each flag's dest is the option's name); the
    same object goes on to the relay."""
    return RouterConfig(
        max_local_prefill_tokens=ns.max_local_prefill_tokens,
        kv_transfer_failure=ns.kv_transfer_failure,
        migration_wait_s=ns.migration_wait_s,
        max_in_flight=ns.max_in_flight,
        max_queued=ns.max_queued,
        max_n=ns.max_n,
        routing_policy=ns.routing_policy,
        served_model_name=ns.served_model_name,
    )


def _kv_secret(ns: argparse.Namespace) -> Any:
    """The KV secret from --kv-secret-file, else the environment's, else None."""
    from kvrelay.transfer.kv_secret import KVSecret

    return KVSecret.from_file(ns.kv_secret_file) if ns.kv_secret_file else KVSecret.from_env()


def cmd_serve(ns: argparse.Namespace) -> int:
    server_config = _server_config(ns)  # a bad TLS flag fails now, not after Ray is up
    # Fail fast (and fetch the default model, or a Hub id's snapshot) before Ray or torch.
    engine_args = _engine_args(ns).with_resolved_model()
    from kvrelay.api.platform import ready_message, run_event_loop, run_router
    from kvrelay.router.workers import WorkerRegistry
    from kvrelay.worker.core_share import ServeCores, serve_board
    from kvrelay.worker.pools import Pools

    num_prefill = 1 if ns.num_prefill is None else ns.num_prefill
    num_workers = ns.num_decode if ns.colocated else num_prefill + ns.num_decode
    cores = os.cpu_count() or 1
    threads = ns.worker_threads or max(1, cores // max(1, num_workers))
    from kvrelay.transfer.factory import pick_backend
    from kvrelay.transfer.tls import KVTLS

    # As the workers will resolve it (a half-set KV TLS config fails here, before Ray).
    transfer = pick_backend(ns.transfer_backend, KVTLS.from_env())
    pools_text = (
        f"{ns.num_decode} colocated worker(s)"
        if ns.colocated
        else f"{num_prefill} prefill + {ns.num_decode} decode worker(s), KV relay over {transfer}"
    )
    print(f"kvrelay: starting {pools_text} on Ray...", flush=True)
    from kvrelay.serve_hint import small_machine_hint

    # Workers on a Ray cluster of their own (not --ray-address) may share the cores by step.
    plan = ServeCores.decide(cores, num_workers, ns.colocated, ns.ray_address is not None)
    if hint := small_machine_hint(os.cpu_count(), ns.colocated, threads if plan.board else None):
        print(hint, flush=True)  # P/D or colocated, measured; how the cores are shared
    with serve_board(plan):  # removed, its name and OpenMP wait unset, when serving ends
        pools = Pools.start(
            str(engine_args.resolve_model_path()),
            num_prefill,
            ns.num_decode,
            ns.colocated,
            ns.transfer_backend,
            {k: v for k, v in dataclasses.asdict(engine_args).items() if k != "model"},
            address=ns.ray_address,
            num_threads=threads,
            kv_secret=_kv_secret(ns),
        )

        async def main() -> None:
            registry = WorkerRegistry()
            for actor in pools.workers:
                await registry.add(actor)

            def ready(server: Any, router: Any) -> None:
                print(ready_message(server, router, pools_text), flush=True)

            await run_router(registry, engine_args, _router_config(ns), server_config, ready)

        try:
            run_event_loop(main())
        finally:
            pools.shutdown()
    print("kvrelay: stopped", flush=True)
    return 0


def cmd_router(ns: argparse.Namespace) -> int:
    server_config = _server_config(ns)  # a bad TLS flag fails now, not after Ray is up
    engine_args = _engine_args(ns).with_resolved_model()  # before Ray, as for serve
    from kvrelay.api.platform import ready_message, run_event_loop, run_router
    from kvrelay.router.discovery import NAMESPACE, WorkerManager, discover_workers
    from kvrelay.router.workers import WorkerRegistry

    join_ray_cluster(ns.ray_address, NAMESPACE, ns.ray_join_timeout)
    background = []
    if ns.manage_workers:
        args = {k: v for k, v in dataclasses.asdict(engine_args).items()}
        from kvrelay.worker.pools import spawn_worker

        manager = WorkerManager(spawn_worker, args, ns.transfer_backend, ns.worker_threads or 1)
        background.append(manager.run())

    async def main() -> None:
        registry = WorkerRegistry(discover=discover_workers)
        await registry.refresh()

        def ready(server: Any, router: Any) -> None:
            print(ready_message(server, router, f"workers on Ray at {ns.ray_address}"), flush=True)

        await run_router(
            registry, engine_args, _router_config(ns), server_config, ready, background
        )

    run_event_loop(main())
    return 0


def cmd_worker(ns: argparse.Namespace) -> int:
    engine_args = _engine_args(ns).with_resolved_model()  # a Hub id fetched before Ray
    import ray

    from kvrelay.router.discovery import NAMESPACE, worker_name
    from kvrelay.worker.pools import spawn_worker

    join_ray_cluster(ns.ray_address, NAMESPACE, ns.ray_join_timeout)
    name = worker_name(ns.role)
    actor = spawn_worker(
        dataclasses.asdict(engine_args),
        ns.role,
        ns.transfer_backend,
        ns.worker_threads or 1,
        name=name,
        namespace=NAMESPACE,
        node_id=ray.get_runtime_context().get_node_id(),
        kv_secret=_kv_secret(ns),
    )
    ray.get(actor.health.remote())
    print(f"kvrelay worker {name} ({ns.role}) is up; Ctrl-C stops it", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    finally:
        ray.kill(actor)
    print(f"kvrelay worker {name}: stopped", file=sys.stderr)
    return 0
