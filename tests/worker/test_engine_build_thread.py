"""A worker builds its engine on a passing thread (worker/engine_builder.py): the OpenMP team
that building creates ends with that thread, so the engine loop's team is the process's only
one and its threads spin between ops instead of sleeping (libgomp throttles spinning once it
manages more threads than there are CPUs)."""

from __future__ import annotations

import os
import threading

import pytest

from kvrelay.worker.engine_builder import in_passing_thread
from tests.fresh_python import run_fresh_python

# OS threads of a 2-thread torch process: at start, after a parallel op run on a passing
# thread, and after the same op run on the main thread (whose team then stays).
_COUNT_THREADS = """
import os, time, torch
torch.set_num_threads(2)
from kvrelay.worker.engine_builder import in_passing_thread
def count(): return len(os.listdir("/proc/self/task"))
def parallel_op(): return float(torch.ones(4_000_000).mul_(2).sum())
start = count()
assert in_passing_thread(parallel_op) == 8_000_000.0
time.sleep(0.5)  # the pool's threads leave as their master's thread ends
passing = count()
parallel_op()
print(start, passing, count())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_build_threads_team_ends_with_it() -> None:
    start, passing, direct = map(int, run_fresh_python(_COUNT_THREADS, "services").split())
    assert passing == start  # nothing the build started outlives it
    assert direct == start + 1  # a team on a lasting thread keeps its worker thread


def test_the_result_and_the_exception_come_back_to_the_caller() -> None:
    caller = threading.get_ident()
    assert in_passing_thread(lambda: threading.get_ident()) != caller

    def fails() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        in_passing_thread(fails)
