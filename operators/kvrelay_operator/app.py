"""`kvrelay operator` / `python -m kvrelay_operator`: its flags and the process that runs
kopf, the probe endpoint and the metrics endpoint. Heavy imports happen inside
`run_operator`, so `--help` stays instant.

Replicas coordinate through kopf peering: each announces itself with a random priority in a
(Cluster)KopfPeering object, only the highest acts, and the others take over when its entry
expires. Equal priorities would pause every replica, hence random ones.
"""

from __future__ import annotations

import argparse
import secrets
import sys

from kvrelay_operator.env import IMAGE, PEERING, PULL_SECRETS


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the operator's flags to `parser` (the `kvrelay operator` subcommand)."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch KVRelayServices in NS (repeatable)",
    )
    scope.add_argument(
        "--all-namespaces", action="store_true", help="watch KVRelayServices in every namespace"
    )
    parser.add_argument(
        "--image",
        default=IMAGE.get(),
        help="image of the pods when a service names none (default $KVRELAY_IMAGE)",
    )
    parser.add_argument(
        "--image-pull-secret",
        action="append",
        default=[s for s in PULL_SECRETS.get().split(",") if s],
        metavar="NAME",
        help="a Secret every service pod pulls its image with, besides the service's own "
        "imagePullSecrets (repeatable; default $KVRELAY_IMAGE_PULL_SECRETS, comma-separated)",
    )
    parser.add_argument(
        "--probe-host",
        default="127.0.0.1",
        help="address of the liveness endpoint /healthz (in a pod: 0.0.0.0; default 127.0.0.1)",
    )
    parser.add_argument(
        "--probe-port", type=int, default=8080, help="port of /healthz (default 8080)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="port of the operator's /metrics, served on --probe-host; 0 turns it off "
        "(default 9090)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="reconcile every service this often, events or not (default 30)",
    )
    _add_coordination_arguments(parser)


def _add_coordination_arguments(parser: argparse.ArgumentParser) -> None:
    """How the replicas share the work (kopf peering) and how often they act."""
    parser.add_argument(
        "--peering",
        default=PEERING.get(),
        metavar="NAME",
        help="kopf peering object shared by the operator's replicas: only one acts "
        "(default $KVRELAY_PEERING or kvrelay; the chart creates it)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: for a single operator where the peering CRDs are not installed",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest live replica acts (default: random)",
    )
    parser.add_argument(
        "--planner-seconds",
        type=float,
        default=15.0,
        help="how often the planner scrapes the routers and sizes the pools (default 15)",
    )


def run_operator(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; returns the exit status."""
    if not args.namespace and not args.all_namespaces:
        print("kvrelay operator: give --namespace NS or --all-namespaces", file=sys.stderr)
        return 2
    if args.resync_seconds <= 0 or args.planner_seconds <= 0:
        print("kvrelay operator: intervals must be positive", file=sys.stderr)
        return 2

    import kopf
    import kubernetes
    from prometheus_client import start_http_server

    from kvrelay_operator.handlers import OperatorState, build_registry
    from kvrelay_operator.kube import Kube
    from kvrelay_operator.metrics import OperatorMetrics

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.probe_host, registry=metrics.registry)
    state = OperatorState(
        kube=Kube(kubernetes.client.ApiClient()),
        default_image=args.image,
        metrics=metrics,
        pull_secrets=tuple(dict.fromkeys(args.image_pull_secret)),
        watched=None if args.all_namespaces else tuple(args.namespace),
    )
    kopf.run(
        registry=build_registry(args.resync_seconds, args.planner_seconds),
        memo=state,
        standalone=args.standalone,
        # A name makes peering mandatory: kopf refuses to run without the peering object
        # rather than acting beside another replica.
        peering_name=None if args.standalone else args.peering,
        priority=args.priority if args.priority is not None else 1 + secrets.randbelow(2**30),
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=f"http://{args.probe_host}:{args.probe_port}/healthz",
    )
    return 0
