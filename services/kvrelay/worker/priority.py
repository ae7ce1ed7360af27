"""The engine's CPU priority: Ray starts worker processes at nice 15, kvrelay's at 0.

Ray lowers every worker process's priority (`worker_niceness`, 15 by default) so that its own
daemons stay responsive beside arbitrary tasks. An engine worker is no arbitrary task: it is
the workload. At nice 15 the scheduler gives it ~3% of a core against any nice-0 thread, so
the router, Ray's agents or a client on the same host preempt it at once; with two OpenMP
threads, one descheduled thread stalls the other at every op's barrier. Served on 2 cores at
16 streams, nice 0 raised throughput 9-12% (paired runs, `vllm bench serve` as the client).

So every Ray cluster kvrelay starts or deploys sets `RAY_worker_niceness=0` (the raylets pass
it to their workers), and a worker that still finds itself niced lowers its niceness where it
may, and says how to fix the cluster where it may not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
ENGINE_NICENESS = 0


def unniced_ray_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Ask a Ray cluster started from this process for nice-0 workers (unless the environment
    already says otherwise): call it before `ray.init` starts a local cluster."""
    environ = os.environ if environ is None else environ
    environ.setdefault(RAY_WORKER_NICENESS_ENV, str(ENGINE_NICENESS))


def raise_engine_priority() -> int:
    """Bring this process back to nice ENGINE_NICENESS if it runs niced; its niceness after.

    Linux keeps a niceness per thread, so every thread there now is set (the engine's loop
    and OpenMP threads, started later, inherit it). Lowering niceness needs CAP_SYS_NICE
    (root has it, pods seldom do): where it is refused, a warning names the cluster setting
    that fixes it."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= ENGINE_NICENESS:
        return niceness
    try:
        for thread_id in _thread_ids():
            _unnice(thread_id)
    except PermissionError:
        logger.warning(
            "this engine runs at nice %d (Ray's worker niceness), so any other process on the "
            "host preempts it; set %s=%d in the environment of the Ray nodes (`ray start`) to "
            "serve at full speed",
            niceness,
            RAY_WORKER_NICENESS_ENV,
            ENGINE_NICENESS,
        )
        return niceness
    return ENGINE_NICENESS


def _unnice(thread_id: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
        os.setpriority(os.PRIO_PROCESS, thread_id, ENGINE_NICENESS)


def _thread_ids() -> list[int]:
    """This process's threads (Linux), this thread first; just this thread elsewhere."""
    own = threading.get_native_id()
    try:
        others = [int(name) for name in os.listdir("/proc/self/task") if int(name) != own]
    except OSError:
        others = []
    return [own, *others]
