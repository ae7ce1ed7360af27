"""The built wheel: it ships the CUDA kernel sources inside `kvrelay_kernels` (an installed
package JIT-builds its CUDA backend from them) and no stray top-level package.

The wheel is built from a copy of the sources in a temporary folder, so the checkout's own
`build/` (stale files from earlier builds, other engineers' builds) neither leaks into the
wheel nor gets written by the test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "kernels" / "csrc"
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
PACKAGE_DIRS = ("services", "kernels", "operators")
KERNEL_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    for name in PACKAGE_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [built] = out.glob("kvrelay-*.whl")
    return built


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_ships_every_cuda_source_inside_the_kernel_package(wheel: Path) -> None:
    expected = sorted(p.name for p in CSRC.iterdir() if p.suffix in KERNEL_SUFFIXES)
    assert "torch_binding.cpp" in expected and any(n.endswith(".cuh") for n in expected)
    shipped = sorted(
        n.removeprefix("kvrelay_kernels/csrc/")
        for n in _names(wheel)
        if n.startswith("kvrelay_kernels/csrc/")
    )
    assert shipped == expected


def test_the_wheel_keeps_the_cpu_kernel_sources(wheel: Path) -> None:
    # Headers too: the extensions include kernel_api.h, and a wheel without it cannot build.
    folder = ROOT / "kernels/kvrelay_kernels/csrc_cpu"
    cpu = sorted(p.name for p in [*folder.glob("*.cpp"), *folder.glob("*.h")])
    assert "kernel_api.h" in cpu
    names = _names(wheel)
    assert all(f"kvrelay_kernels/csrc_cpu/{name}" in names for name in cpu)


def test_the_wheel_has_only_the_three_packages_at_the_top(wheel: Path) -> None:
    # kernels/csrc holds a script but is no package: it must not install as `csrc`.
    tops = {n.split("/")[0] for n in _names(wheel) if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvrelay", "kvrelay_kernels", "kvrelay_operator"}


def test_an_installed_wheel_finds_its_cuda_sources(wheel: Path, tmp_path: Path) -> None:
    """csrc_dir() of the unpacked wheel (first on sys.path) points inside the package, where
    the JIT build finds every source it compiles."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    probe = (
        "from kvrelay_kernels import cuda_backend as c; "
        "print(c.__file__); print(c.csrc_dir()); print(all(s.is_file() for s in c.sources()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    module_file, folder, every_source = proc.stdout.split()
    assert Path(module_file).is_relative_to(site), "the checkout's package was imported instead"
    assert Path(folder) == site / "kvrelay_kernels" / "csrc"
    assert every_source == "True"
