"""Where a worker's memory is: glibc's heap (mallinfo2), the kernel's view (smaps_rollup),
live Python objects and torch tensors, and optionally tracemalloc's growth by line; with
$KVRELAY_MEMORY_PROBE=<directory> a worker appends one JSON line of these to
<directory>/memory-<pid>.jsonl every $KVRELAY_MEMORY_PROBE_S seconds (benchmarks/memory_soak.py
--probe sets it and summarizes them).

A diagnostic: it never frees or changes anything it looks at (worker/heap_trim.py does).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from kvrelay.common import env

logger = logging.getLogger(__name__)

PROBE_ENV = env.MEMORY_PROBE.name  # a directory: each worker appends to memory-<pid>.jsonl
PROBE_PERIOD_ENV = env.MEMORY_PROBE_S.name  # seconds between lines (default 30)
PROBE_TRACEMALLOC_ENV = env.MEMORY_PROBE_TRACEMALLOC.name  # "1": also tracemalloc's growth
_MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")  # fmt: skip


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def mallinfo2() -> dict[str, int]:
    """glibc's heap totals in bytes (`arena`: sbrk'd main heap + other arenas' heaps,
    `hblkhd`: mmap'd chunks, `uordblks`: in use, `fordblks`: free but kept); {} where libc
    has no mallinfo2 (musl, glibc < 2.33)."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return {}
    fn.restype = _Mallinfo2
    info = fn()
    return {name: int(getattr(info, name)) for name in _MALLINFO2_FIELDS}


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """/proc/<pid>/smaps_rollup's kB fields (Rss, Anonymous, Pss_File, ...), in kB; {} off
    Linux."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    fields: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[name.strip()] = int(parts[0])
    return fields


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def object_census(top: int = 15) -> dict[str, Any]:
    """Counts of the gc-tracked objects by type (the `top` commonest) and the torch tensors
    among them (count, bytes of their storages, each storage once). A worker's start-up
    objects (the model's weights among them) are frozen out of the collector's sight
    (engine_builder.freeze_start_up_objects), so there it counts what came after: what a
    leak would add to. Other threads are paused meanwhile (`_other_threads_paused`)."""
    with _CENSUS_LOCK, _other_threads_paused():
        try:
            return _census(top)  # its frame, and every reference it took, is gone on return
        except Exception as exc:
            # The traceback holds the census's frame (the object list): dropped while paused.
            failure = repr(exc)
    raise RuntimeError(f"object census failed: {failure}")


def _census(top: int) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    storages: dict[int, int] = {}
    objects = gc.get_objects()
    # type(), not isinstance: isinstance reads `__class__`, which some lazy modules answer
    # with a deprecation warning (torch.distributed.reduce_op).
    found = [obj for obj in objects if issubclass(type(obj), torch.Tensor)]
    for obj in objects:
        counts[type(obj).__name__] += 1
    for tensor in found:
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # meta or sparse tensors
            continue
    return {
        "objects": len(objects),
        "types": dict(counts.most_common(top)),
        "tensors": len(found),
        "tensor_bytes": sum(storages.values()),
    }


# While the census holds gc.get_objects()' list, no forced thread switch: it is far longer
# than a census takes (tens of ms at a million objects).
_PAUSED_SWITCH_INTERVAL_S = 1000.0
_CENSUS_LOCK = threading.Lock()


@contextlib.contextmanager
def _other_threads_paused() -> Iterator[None]:
    """Keep the GIL on this thread: no other Python thread runs until the block ends.

    gc.get_objects() hands out objects still being built, among them a tuple another thread
    is filling from a generator. CPython shrinks such a tuple in place at the end, which it
    refuses (SystemError "bad argument to internal function") while anything else holds a
    reference: a census that let that thread run while it held the list crashed the engine's
    step in CI. So no forced switch while the census runs, and no collection either (a
    finalizer doing I/O would release the GIL). A thread that was already waiting for the
    GIL waits out its old interval once (the sleep) before the census starts."""
    interval = sys.getswitchinterval()
    collecting = gc.isenabled()
    sys.setswitchinterval(_PAUSED_SWITCH_INTERVAL_S)
    try:
        time.sleep(2 * interval)
        gc.disable()
        yield
    finally:
        if collecting:
            gc.enable()
        sys.setswitchinterval(interval)


class TracemallocGrowth:
    """tracemalloc's growth by line since the first `sample`: starts tracing when made."""

    def __init__(self, frames: int = 8) -> None:
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start(frames)
        self._base: tracemalloc.Snapshot | None = None

    def stop(self) -> None:
        """Stop tracing if this started it (tracing slows every allocation)."""
        if self._started:
            tracemalloc.stop()
            self._started = False

    def sample(self, top: int = 10) -> list[dict[str, Any]]:
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        if self._base is None:
            self._base = snapshot
            return []
        diff = snapshot.compare_to(self._base, "traceback")[:top]
        return [
            {
                "size_diff": stat.size_diff,
                "count_diff": stat.count_diff,
                "where": [f"{f.filename}:{f.lineno}" for f in stat.traceback][-4:],
            }
            for stat in diff
        ]


Sizes = Callable[[], Mapping[str, int]]


def probe_line(sizes: Sizes | None, growth: TracemallocGrowth | None) -> dict[str, Any]:
    """One probe's record: time, pid, threads, smaps_rollup, mallinfo2, the object census,
    `sizes()` (a worker's per-request structures) and tracemalloc's growth."""
    record: dict[str, Any] = {
        "t": time.time(),
        "pid": os.getpid(),
        "threads": thread_count(),
        "smaps_kb": smaps_rollup(),
        "mallinfo2": mallinfo2(),
        "census": object_census(),
    }
    if sizes is not None:
        try:
            record["sizes"] = dict(sizes())
        except Exception as exc:  # read from another thread: a dict may change size
            record["sizes"] = {"error": repr(exc)}
    if growth is not None:
        record["tracemalloc"] = growth.sample()
    return record


class RunningProbe:
    """A probe thread; `stop` ends it (a worker's shutdown does: otherwise it would outlive
    the worker, keep it alive and keep writing)."""

    def __init__(self, run: Callable[[threading.Event], None]) -> None:
        self._stopping = threading.Event()
        self.thread = threading.Thread(
            target=run, args=(self._stopping,), name="memory-probe", daemon=True
        )
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)


def start_probe(
    sizes: Sizes | None = None, environ: Mapping[str, str] | None = None
) -> RunningProbe | None:
    """With $KVRELAY_MEMORY_PROBE set, a daemon thread appending `probe_line`s to
    memory-<pid>.jsonl in that directory every $KVRELAY_MEMORY_PROBE_S seconds (default 30)
    until stopped; None when it is unset."""
    directory = env.MEMORY_PROBE.get(environ).strip()
    if not directory:
        return None
    if not Path(directory).is_dir():
        raise ValueError(f"${PROBE_ENV} must name an existing directory, not {directory!r}")
    path = Path(directory) / f"memory-{os.getpid()}.jsonl"
    raw_period = env.MEMORY_PROBE_S.get(environ)
    try:
        period = float(raw_period)
    except ValueError:
        period = -1.0
    if not period > 0:
        raise ValueError(f"${PROBE_PERIOD_ENV} must be a number of seconds > 0, not {raw_period!r}")
    tracing = env.MEMORY_PROBE_TRACEMALLOC.get(environ) == "1"
    growth = TracemallocGrowth() if tracing else None

    def run(stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                line = json.dumps(probe_line(sizes, growth))
                with open(path, "a") as out:
                    out.write(line + "\n")
            except Exception:
                logger.exception("memory probe failed; it stops")
                break
            stopping.wait(period)
        if growth is not None:
            growth.stop()

    return RunningProbe(run)


# A worker's per-request structures, as dotted paths from the EngineWorker: each should come
# back to its idle size once the requests are done. Private names on purpose (a diagnostic);
# a path that no longer resolves is reported as -1, never an error.
WORKER_STRUCTURES = (
    "loop._streams",
    "engine._parents",
    "engine._owner",
    "engine._finished_outside_step",
    "engine.scheduler.waiting",
    "engine.scheduler.running",
    "engine.scheduler.waiting_for_remote_kv",
    "engine.scheduler._forks",
    "engine.scheduler._last_running",
    "engine.scheduler._last_order",
    "engine.handoff._leases._leases",
    "engine.handoff._leases._by_handle",
    "engine.handoff._pulls",
    "engine.kv_cache._tables",
    "engine.kv_cache._num_cached",
    "engine.kv_cache._copies",
    "engine.kv_cache._changed",
    "engine.kv_cache.pool._cached",
    "engine.runner.uploader.table._row_of",
    "channels._channels",
)


def structure_sizes(root: object, paths: tuple[str, ...] = WORKER_STRUCTURES) -> dict[str, int]:
    """len() of each dotted path under `root` (-1 where it does not resolve), plus the tasks
    of `root.channels`' open channels."""
    sizes: dict[str, int] = {}
    for path in paths:
        obj: Any = root
        for name in path.split("."):
            obj = getattr(obj, name, None)
        try:
            sizes[path] = len(obj) if obj is not None else -1
        except TypeError:
            sizes[path] = -1
    channels = getattr(getattr(root, "channels", None), "_channels", {})
    sizes["channel tasks"] = sum(len(getattr(c, "_tasks", ())) for c in list(channels.values()))
    return sizes
