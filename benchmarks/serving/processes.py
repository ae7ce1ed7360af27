"""The server's processes as /proc shows them: the tree under a pid, each one's RSS, and the
process listening on a loopback port (for benchmarks pointed at a server started elsewhere)."""

from __future__ import annotations

import collections
import itertools
import os
import re
from pathlib import Path

# The router's WARNING when a worker joins (router/workers.py):
# "worker <engine_id> (<role>, pid <pid>[, pod <pod>, revision <revision>]) joined".
WORKER_JOINED = re.compile(r"worker (?P<id>\S+) \((?P<role>\w+), pid (?P<pid>\d+)[^)]*\) joined")


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(name, parent pid) from /proc/PID; None once the process is gone. The name is the
    command line's first words (Ray titles its workers `ray::EngineWorker...`)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [Path(a.decode(errors="replace")).name for a in argv[:4] if a and a != b"-m"]
    name = " ".join(words) or stat[stat.index("(") + 1 : stat.rindex(")")]
    return name, int(stat[stat.rindex(")") + 2 :].split()[1])


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def process_tree(root: int) -> dict[int, str]:
    """The server process and all its descendants (Ray's raylet, GCS and workers), by pid."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
            names[int(entry.name)] = stat[0]
            children[stat[1]].append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in names:
            tree[pid] = names[pid]
            todo.extend(children[pid])
    return tree


def listening_pid(port: int) -> int | None:
    """The process listening on a loopback TCP port (for --url): socket inode -> owner."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in itertools.islice(f, 1, None):
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(link == f"socket:[{inode}]" for link in links for inode in inodes):
            return int(entry.name)
    return None


def rss_snapshot(root: int | None) -> dict[int, tuple[str, float]]:
    if root is None:
        return {}
    return {pid: (name, rss) for pid, name in process_tree(root).items()
            if (rss := rss_mib(pid)) is not None}  # fmt: skip


def cpu_seconds(root: int | None) -> float:
    """User + system CPU seconds of the server's live process tree so far (0 without one):
    the difference over a run, divided by its wall time, is how many cores the server kept
    busy."""
    if root is None:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in process_tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone between the listing and now
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / ticks
