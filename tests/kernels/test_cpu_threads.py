"""Threads beside the engine run torch's CPU ops on one thread each (cpu_threads.py): a
lasting helper thread that did a parallel op keeps no OpenMP team, and the process's other
threads keep their thread count."""

from __future__ import annotations

import os

import pytest

from tests.fresh_python import run_fresh_python

# OS threads of a 2-thread torch process: at start, with a lasting helper thread that ran a
# parallel op after use_one_cpu_thread, and with a second one that ran it without.
_COUNT_THREADS = """
import os, threading, torch
torch.set_num_threads(2)
from kvrelay_kernels.cpu_threads import use_one_cpu_thread
def count(): return len(os.listdir("/proc/self/task"))
done = threading.Event()
def helper(limited, ready, answer):
    if limited:
        use_one_cpu_thread()
    answer.append((float(torch.ones(4_000_000).mul_(2).sum()), torch.get_num_threads()))
    ready.set()
    done.wait()
counts, answers = [count()], []
for limited in (True, False):
    ready = threading.Event()
    threading.Thread(target=helper, args=(limited, ready, answers), daemon=True).start()
    ready.wait()
    counts.append(count())
print(*counts, *(x for pair in answers for x in pair), torch.get_num_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_helper_thread_runs_its_ops_without_a_team() -> None:
    start, limited, unlimited, *rest = run_fresh_python(_COUNT_THREADS, "kernels").split()
    assert int(limited) == int(start) + 1  # the helper itself, no team worker
    assert int(unlimited) == int(limited) + 2  # a helper and its team's worker thread
    sum_limited, threads_limited, sum_unlimited, threads_unlimited, main_threads = rest
    assert float(sum_limited) == float(sum_unlimited) == 8_000_000.0
    assert (int(threads_limited), int(threads_unlimited), int(main_threads)) == (1, 2, 2)
