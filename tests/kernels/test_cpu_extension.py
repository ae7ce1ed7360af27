"""Where the CPU extensions' native builds are cached, and locks that killed builds leave."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvrelay_kernels.cpu_extension import build_guard, build_name


def test_native_builds_are_named_per_cpu_flags() -> None:
    """A `-march=native` build is cached under a name carrying the CPU's instruction sets, so
    a home folder shared with a machine lacking AVX-512 never loads this one's build."""
    avx512 = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
    avx2 = frozenset({"fpu", "avx2"})
    assert build_name("kvrelay_x", avx512) != build_name("kvrelay_x", avx2)
    assert build_name("kvrelay_x", avx2) == build_name("kvrelay_x", frozenset(sorted(avx2)))
    assert build_name("kvrelay_x", avx2).startswith("kvrelay_x_")
    assert build_name("kvrelay_x").isidentifier()  # it is the Python module's name too


def test_a_lock_left_by_a_dead_process_is_removed_and_a_live_holder_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory("kvrelay_lock_probe", False))
    assert folder.is_relative_to(tmp_path)
    lock = folder / "lock"
    lock.touch()  # torch's lock, left by a process killed inside load
    with build_guard("kvrelay_lock_probe"):
        assert not lock.exists()
    # A live holder (another process inside its guard) is waited for; once it is killed,
    # the kernel drops its flock and the guard goes on.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_GUARD, str(folder / "kvrelay.flock")], stdout=subprocess.PIPE
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    waiter = threading.Thread(target=enter_and_leave_the_guard)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # blocked behind the live holder
    holder.kill()
    holder.wait()
    waiter.join(10.0)
    assert not waiter.is_alive()


def enter_and_leave_the_guard() -> None:
    with build_guard("kvrelay_lock_probe"):
        pass


HOLD_GUARD = """
import fcntl, sys, time
guard = open(sys.argv[1], "a+b")
fcntl.flock(guard, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""
