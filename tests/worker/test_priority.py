"""The engine's CPU priority (worker/priority.py): Ray starts its workers at nice 15; kvrelay's
clusters ask for 0, and a niced engine raises itself, or says how to fix the cluster."""

from __future__ import annotations

import os

import pytest

from kvrelay.worker.priority import RAY_WORKER_NICENESS_ENV, unniced_ray_env
from tests.fresh_python import run_fresh_python

# Niced to Ray's 15 with a second thread already running, then raised: every thread's
# niceness after, and the function's answer.
_RAISE = """
import logging, os, threading, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
os.nice(15)
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
from kvrelay.worker.priority import raise_engine_priority
if {drop_rights} and os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)  # no CAP_SYS_NICE, as in most pods
result = raise_engine_priority()
tasks = sorted(int(t) for t in os.listdir("/proc/self/task"))
print("threads", [os.getpriority(os.PRIO_PROCESS, t) for t in tasks], "result", result)
"""


def _run(drop_rights: bool) -> str:
    return run_fresh_python(_RAISE.format(drop_rights=drop_rights), "services", timeout=60)


def test_a_local_cluster_asks_for_unniced_workers_unless_told_otherwise() -> None:
    environ: dict[str, str] = {}
    unniced_ray_env(environ)
    assert environ == {RAY_WORKER_NICENESS_ENV: "0"}
    environ = {RAY_WORKER_NICENESS_ENV: "5"}  # an operator's choice stands
    unniced_ray_env(environ)
    assert environ == {RAY_WORKER_NICENESS_ENV: "5"}


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs CAP_SYS_NICE")
def test_a_niced_engine_raises_every_thread_where_it_may() -> None:
    out = _run(drop_rights=False)
    assert out.strip().endswith("threads [0, 0] result 0"), out


def test_where_it_may_not_it_says_which_setting_fixes_the_cluster() -> None:
    out = _run(drop_rights=True)
    assert "threads [15, 15] result 15" in out, out
    assert "runs at nice 15" in out and "RAY_worker_niceness=0" in out, out
