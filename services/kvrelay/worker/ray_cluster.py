"""Joining an existing Ray cluster, waiting for it to come up.

On Kubernetes the router's pod, the worker pods and the Ray head start together: a router
that finds the head's GCS not yet up, or up with no node registered ("No node info found
matching attributes"), would exit and be restarted by its Deployment with a growing backoff.
Waiting here, with a line saying what it waits for, joins as soon as the head is ready.

`ray.init` itself waits minutes, silently, for a GCS port that nothing listens on; a TCP
connect to the address first turns that into a retry here, bounded by the timeout.
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


def join_ray_cluster(
    address: str, namespace: str | None = None, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
) -> None:
    """`ray.init(address=...)`, retried every few seconds until `timeout_s` has passed.

    Raises:
        RayClusterUnavailable: no attempt succeeded in `timeout_s` (the last error is chained).
    """
    import ray

    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        attempt += 1
        try:
            _check_listening(address)
            ray.init(address=address, namespace=namespace)
            if attempt > 1:
                logger.warning("joined the Ray cluster at %s (attempt %d)", address, attempt)
            return
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
