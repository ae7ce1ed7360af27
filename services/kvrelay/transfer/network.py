"""Where a worker's KV transports listen: loopback unless configured (a local `serve`), the
configured interface in a cluster; and whether the gRPC channel runs mTLS (transfer/tls.py).
Read from the environment, which Kubernetes sets per pod ($KVRELAY_KV_HOST from status.podIP).

Peers are told the address that is bound, never a wildcard (0.0.0.0 or ::, which a peer would
dial as its own loopback): a wildcard bind needs $KVRELAY_KV_ADVERTISE_HOST. A host name is
advertised as is, for the puller to resolve (a Service name, or a certificate's name).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from kvrelay.common.env import KV_ADVERTISE_HOST, KV_HOST
from kvrelay.transfer.tls import KVTLS

logger = logging.getLogger(__name__)

KV_HOST_ENV = KV_HOST.name  # the address the KV servers bind (a pod: its IP)
KV_ADVERTISE_HOST_ENV = KV_ADVERTISE_HOST.name  # what peers dial, if not KV_HOST
UCX_NET_DEVICES_ENV = "UCX_NET_DEVICES"  # UCX's own setting; when set, it is kept as is
LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class KVNetwork:
    """`host`: the gRPC KV server's bind address; `advertise_host`: what peers dial (default
    `host`); `ucx_net_devices`: the network devices UCX (NIXL) may listen on, None for all;
    `tls`: mTLS for the gRPC KV channel (None: plaintext).

    Raises:
        ValueError: the address peers would dial is a wildcard (see `peer_host`).
    """

    host: str = LOOPBACK
    advertise_host: str | None = None
    ucx_net_devices: str | None = "lo"
    tls: KVTLS | None = None

    def __post_init__(self) -> None:
        if is_wildcard(self.peer_host):
            raise ValueError(
                f"the KV server would tell peers to dial {self.peer_host}, which is no address "
                f"(it binds every interface): set ${KV_HOST_ENV} to the pod's IP "
                f"(status.podIP), or ${KV_ADVERTISE_HOST_ENV} to the address peers reach"
            )

    @property
    def peer_host(self) -> str:
        """The address peers dial: the advertised one, else the bound one."""
        return self.advertise_host or self.host

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVNetwork:
        """$KVRELAY_KV_HOST (default loopback) and $KVRELAY_KV_ADVERTISE_HOST; UCX's devices
        from $UCX_NET_DEVICES, else the interface that holds the KV host's address; TLS from
        $KVRELAY_KV_TLS_CERT / _KEY / _CA / _SERVER_NAME (KVTLS.from_env).

        The advertised host is always set (to the bound one when not given), so a connector
        built from this network tells peers exactly where it listens.

        Raises:
            KVTLSError: the TLS settings are incomplete or unreadable.
            ValueError: a wildcard bind without an advertised address.
        """
        env = os.environ if environ is None else environ
        host = KV_HOST.get(env).strip() or LOOPBACK
        advertise = KV_ADVERTISE_HOST.get(env).strip() or host
        devices = env.get(UCX_NET_DEVICES_ENV, "").strip() or interface_of(host)
        if devices is None:
            logger.warning(
                "KV host %s is on no interface found here: UCX will listen on every interface; "
                "set %s to the one it should use",
                host,
                UCX_NET_DEVICES_ENV,
            )
        return cls(host, advertise, devices, KVTLS.from_env(env))


def is_wildcard(host: str) -> bool:
    """Whether `host` is an unspecified address (0.0.0.0, ::, [::]): bindable, not dialable."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host.strip() == ""


def interface_of(host: str) -> str | None:
    """The name of the local interface holding `host`'s IPv4 address ("lo" for loopback);
    None when none does (or `host` is a wildcard such as 0.0.0.0)."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_loopback:
        return "lo"
    if address.is_unspecified:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(address):
            return name
    return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15])
            )
        except OSError:  # an interface without an IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])
