"""The TCP listening sockets of a process tree, read from Linux's /proc (no psutil in the
venv): which addresses a process and its descendants accept connections on."""

from __future__ import annotations

import http.client
import ipaddress
import itertools
import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    host: str
    port: int

    @property
    def is_wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::")


def _ip(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address column: host-order 32-bit words, as hex."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (host, port) of every listening TCP socket in this network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            host, port = fields[1].split(":")
            out[int(fields[9])] = (_ip(host), int(port, 16))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:  # gone, or not ours
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / str(pid) / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _parent(pid: str) -> int | None:
    try:
        stat = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces


def process_tree(root: int) -> list[int]:
    """`root` and every descendant alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit() and (parent := _parent(entry)) is not None:
            children.setdefault(parent, []).append(int(entry))
    tree = [root]
    for pid in tree:
        tree.extend(children.get(pid, []))
    return tree


def command_line(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def tree_listeners(root: int) -> list[Listener]:
    """Every TCP listener of `root` and its descendants."""
    sockets = listening_sockets()
    return [
        Listener(pid, command_line(pid), *sockets[inode])
        for pid in process_tree(root)
        for inode in sorted(_socket_inodes(pid))
        if inode in sockets
    ]


def is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def host_addresses() -> list[str]:
    """This host's own non-loopback IPv4 addresses (the kernel's local routes)."""
    try:
        lines = (PROC / "net" / "fib_trie").read_text().splitlines()
    except OSError:
        return []
    found = []
    for previous, line in itertools.pairwise(lines):
        if line.strip() == "/32 host LOCAL":
            host = previous.split()[-1]
            if not is_loopback(host) and host not in found:
                found.append(host)
    return found


def http_status(host: str, port: int) -> int | None:
    """The status of a plain `GET /` with no credentials, None when no HTTP answer comes."""
    connection = http.client.HTTPConnection(host, port, timeout=3)
    try:
        connection.request("GET", "/")
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def off_loopback(listeners: list[Listener]) -> list[Listener]:
    return [listener for listener in listeners if not is_loopback(listener.host)]


def http_answers(listeners: list[Listener], addresses: list[str]) -> list[str]:
    """Each listener's port tried on each of `addresses` with a plain `GET /` and no
    credentials: a line for each that answers with a success (below 400)."""
    return [
        f"{address}:{lis.port} -> HTTP {status} (pid {lis.pid}, {lis.command[:80]})"
        for lis in listeners
        for address in addresses
        if (status := http_status(address, lis.port)) is not None and status < 400
    ]


def describe(listeners: list[Listener]) -> str:
    return "\n".join(f"  {x.host}:{x.port}  pid {x.pid}  {x.command[:100]}" for x in listeners)
