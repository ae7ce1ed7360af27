"""The one-node Ray cluster `kvrelay serve` starts for itself: every listener on loopback,
Ray's token authentication on.

Nothing off this host needs to reach that cluster: its workers, GCS, raylet and agents all run
here. Ray on Linux, though, binds its gRPC servers (GCS, raylet, object manager, each worker's
core worker) to all interfaces, the runtime-env agent to the host's outward IP and the
autoscaler's Prometheus endpoint to 0.0.0.0 (measured: 8 listeners off loopback, one answering
plain HTTP). Each of them binds to loopback when the node's address is loopback, which Ray
allows only as a one-machine cluster (macOS and Windows run so by default). This module starts
Ray that way. It must not be used to join a cluster: there the driver must be reachable.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping

from kvrelay.worker.priority import unniced_ray_env

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Ray's switch between "one machine" (node address: loopback) and "may span hosts" (node
# address: the host's outward IP, even when 127.0.0.1 is asked for); read by
# ray._private.ray_constants when Ray is first imported.
RAY_ONE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray >= 2.52: "token" makes every Ray gRPC and HTTP entry point ask for the cluster's token
# (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which a new local cluster
# creates when missing); "disabled" turns that off; unset, Ray 2.60 turns it on for a new
# local cluster.
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_MODE = "token"


def start_local_ray(num_cpus: int | None) -> None:
    """`ray.init` of a new one-node cluster for this process's workers, on loopback only,
    with nice-0 workers (priority.py) and Ray's token authentication (a warning when
    RAY_AUTH_MODE turns it off, or when either did not take)."""
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    unniced_ray_env()
    warn_if_auth_disabled()
    with one_machine_ray():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,  # the dashboard can submit jobs: never started
            logging_level=logging.WARNING,
            _node_ip_address=LOOPBACK,
        )
    warn_unless_loopback(ray.util.get_node_ip_address())
    if not is_token_auth_enabled() and RAY_AUTH_MODE_ENV not in os.environ:
        logger.warning(
            "Ray started without token authentication (this Ray release does not turn it on "
            "by default): set %s=%s before starting kvrelay",
            RAY_AUTH_MODE_ENV,
            RAY_AUTH_TOKEN_MODE,
        )


def warn_if_auth_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether RAY_AUTH_MODE leaves Ray's token authentication on; a warning when it does not.

    Unset is left unset: Ray 2.60 then turns token authentication on for a new local cluster
    itself, and only so does the process that imported Ray see the mode (Ray reads its C++
    config once; a RAY_AUTH_MODE set after that reaches the GCS but not this driver's client,
    which the GCS then refuses)."""
    environ = os.environ if environ is None else environ
    mode = environ.get(RAY_AUTH_MODE_ENV)
    if mode is None or mode.strip().lower() == RAY_AUTH_TOKEN_MODE:
        return True
    logger.warning(
        "%s=%s: the local Ray cluster answers without a token (its listeners are on loopback, "
        "so any process of any user on this host can run code in it); unset it to turn "
        "Ray's token authentication back on",
        RAY_AUTH_MODE_ENV,
        mode,
    )
    return False


@contextlib.contextmanager
def one_machine_ray(environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """Within: Ray starts a cluster whose node address is loopback (see the module docstring).

    The variable is set for the processes Ray starts meanwhile (GCS, raylet, agents; the
    raylet passes its environment on to the workers it starts later), and also as the value
    Ray already read if it was imported before (the router imports it). Both are restored on
    exit, so a later `ray.init(address=...)` of a real cluster from this process advertises an
    address other hosts can reach."""
    environ = os.environ if environ is None else environ
    from ray._private import ray_constants

    old_env = environ.get(RAY_ONE_MACHINE_ENV)
    old_constant = ray_constants.ENABLE_RAY_CLUSTER
    environ[RAY_ONE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_constant
        if old_env is None:
            environ.pop(RAY_ONE_MACHINE_ENV, None)
        else:
            environ[RAY_ONE_MACHINE_ENV] = old_env


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback IP (127.0.0.0/8, ::1, or one mapped into IPv6)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def warn_unless_loopback(node_ip: str) -> bool:
    """Whether the started node's address is loopback; a warning saying what is exposed and
    what to do when it is not (a Ray release that ignores the switch above would do that)."""
    if is_loopback(node_ip):
        return True
    logger.warning(
        "the local Ray cluster took the address %s instead of %s: its GCS, raylet and worker "
        "listeners are reachable from other hosts (token authentication still applies). "
        "Firewall this host's Ray ports, or serve from a secured cluster with --ray-address "
        "(docs/operations.md, 'Ray's listeners')",
        node_ip,
        LOOPBACK,
    )
    return False
