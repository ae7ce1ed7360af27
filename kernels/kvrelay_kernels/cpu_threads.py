"""Threads beside the engine loop run torch's CPU ops on one thread each.

libgomp (torch's OpenMP runtime) gives every thread that runs a parallel op a team of its own,
kept until that thread ends; once it manages more threads than the process has CPUs, a waiting
team thread spins 100 times instead of ~300,000 before it sleeps, and each of an engine step's
~1,000 parallel ops then wakes a sleeping thread (a served decode step took twice the offline
one for this; see kvrelay/worker/engine_builder.py). Threads that live as long as a worker and
copy KV blocks (gRPC pulls into the cache, the gRPC KV server's reads) call
`use_one_cpu_thread` first, so the engine loop's team stays the process's only one.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch


def use_one_cpu_thread() -> None:
    """Make torch's CPU ops single-threaded on the calling thread only (no OpenMP team);
    other threads and torch's global setting keep theirs. For a thread pool's initializer."""
    # torch sets a thread's OpenMP count at the thread's first use of it: now, so ours stays.
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None (another runtime)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libgomp" in path and path.endswith((".so", ".so.1")):
            return ctypes.CDLL(path)
    return None
