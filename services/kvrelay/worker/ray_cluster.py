"""Joining an existing Ray cluster, waiting for it to come up.

On Kubernetes the router's pod, the worker pods and the Ray head start together: a router
that finds the head's GCS not yet up, or up with no node registered ("No node info found
matching attributes"), would exit and be restarted by its Deployment with a growing backoff.
Waiting here, with a line saying what it waits for, joins as soon as the head is ready.

`ray.init` itself waits minutes, silently, for a GCS port that nothing listens on; a TCP
connect to the address first turns that into a retry here, bounded by the timeout.

A cluster with token authentication (RAY_AUTH_MODE=token; the operator's always has it)
refuses a process without its token, which `ray.init` reports as a timeout ("Failed to connect",
"ray client connection timeout") after the whole wait. One call with the token this process
would send tells that apart at once, and the error names the token instead of the address.
"""

from __future__ import annotations

import logging
import socket
import time

logger = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT_S = 120.0
_RETRY_S = 2.0


class RayClusterUnavailable(RuntimeError):
    """The Ray cluster at an address could not be joined in time."""


class RayTokenRefused(RayClusterUnavailable):
    """The Ray cluster at an address refused this process's token: waiting will not help."""


def join_ray_cluster(
    address: str, namespace: str | None = None, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
) -> None:
    """`ray.init(address=...)`, retried every few seconds until `timeout_s` has passed.

    Raises:
        RayTokenRefused: the cluster refused this process's Ray token (at once, no retry).
        RayClusterUnavailable: no attempt succeeded in `timeout_s` (the last error is chained).
    """
    import ray

    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        attempt += 1
        try:
            _check_listening(address)
            if token_refused(address):
                raise RayTokenRefused(_TOKEN_REFUSED.format(address=address))
            ray.init(address=address, namespace=namespace)
            if attempt > 1:
                logger.warning("joined the Ray cluster at %s (attempt %d)", address, attempt)
            return
        except RayTokenRefused:
            raise
        except (ConnectionError, RuntimeError) as error:
            ray.shutdown()  # a half-made connection would make the next init a no-op
            if time.monotonic() + _RETRY_S > deadline:
                raise RayClusterUnavailable(
                    f"no Ray cluster could be joined at {address!r} in {timeout_s:.0f} s "
                    f"({attempt} attempts; last: {error}). Check that the Ray head is running "
                    "and that the address (--ray-address) is right."
                ) from error
            if attempt == 1:
                logger.warning("waiting for the Ray cluster at %s: %s", address, error)
            time.sleep(_RETRY_S)


_TOKEN_REFUSED = (
    "the Ray cluster at {address!r} refused this process's Ray token (Ray's token "
    "authentication is on there). Give this process the cluster's token: RAY_AUTH_MODE=token "
    "and RAY_AUTH_TOKEN (on Kubernetes the operator sets it from the Secret "
    "<service>-ray-auth), RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token."
)


def token_refused(address: str) -> bool:
    """Whether the Ray cluster at `address` answers a call that carries this process's
    token (none unless RAY_AUTH_MODE=token) with UNAUTHENTICATED: the GCS for `host:port`,
    the Ray client server for `ray://host:port`. Any other outcome, a refused connection or a
    success, is False (for `ray.init` to meet and report); forms such as `auto` are False."""
    import grpc
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple,
    )
    from ray.core.generated import (
        gcs_service_pb2,
        gcs_service_pb2_grpc,
        ray_client_pb2,
        ray_client_pb2_grpc,
    )

    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return False
    metadata = _get_authentication_metadata_tuple()  # what Ray itself would send
    with grpc.insecure_channel(target) as channel:
        try:
            if client:
                ping = ray_client_pb2.ClusterInfoType.PING  # type: ignore[attr-defined]
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                    ray_client_pb2.ClusterInfoRequest(type=ping),  # type: ignore[attr-defined]
                    metadata=metadata,
                    timeout=10,
                )
            else:
                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(),  # type: ignore[attr-defined]
                    metadata=metadata,
                    timeout=10,
                )
        except grpc.RpcError as error:
            return bool(error.code() == grpc.StatusCode.UNAUTHENTICATED)
    return False


def _check_listening(address: str) -> None:
    """Raise ConnectionError unless something accepts TCP connections at `address`
    (`host:port` or `ray://host:port`; other forms, such as `auto`, are left to Ray)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    except OSError as error:
        raise ConnectionError(f"nothing accepts connections at {host}:{port} ({error})") from error
