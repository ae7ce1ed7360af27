"""Where the CPU extensions' native builds are cached, and locks that killed builds leave."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvrelay_kernels.cpu_extension import build_name, clear_stale_build_lock


def test_native_builds_are_named_per_cpu_flags() -> None:
    """A `-march=native` build is cached under a name carrying the CPU's instruction sets, so
    a home folder shared with a machine lacking AVX-512 never loads this one's build."""
    avx512 = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
    avx2 = frozenset({"fpu", "avx2"})
    assert build_name("kvrelay_x", avx512) != build_name("kvrelay_x", avx2)
    assert build_name("kvrelay_x", avx2) == build_name("kvrelay_x", frozenset(sorted(avx2)))
    assert build_name("kvrelay_x", avx2).startswith("kvrelay_x_")
    assert build_name("kvrelay_x").isidentifier()  # it is the Python module's name too


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory("kvrelay_lock_probe", False))
    assert folder.is_relative_to(tmp_path)
    assert not clear_stale_build_lock("kvrelay_lock_probe")  # no lock: nothing to do
    lock = folder / "lock"
    lock.touch()
    assert not clear_stale_build_lock("kvrelay_lock_probe")  # a build may be running
    assert lock.exists()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    assert clear_stale_build_lock("kvrelay_lock_probe")
    assert not lock.exists()
