"""`make kernels-check`'s compiler lookup: nvcc from the PATH as it is, else NVIDIA's PyPI
compiler wheels installed once (atomically) into a cache folder. pip is replaced by a fake
that lays out what the wheels unpack to; the real install is checked by hand (see report)
and, where a toolchain is cached already, by the last test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernels" / "csrc" / "check_kernels.py"


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script(SCRIPT)


def _lay_out_toolchain(check: ModuleType, target: Path, *, with_cicc: bool = True) -> None:
    """What the five wheels unpack to, as far as cached_nvcc looks."""
    top = target / check.TOOLCHAIN_PREFIX
    (top / "bin").mkdir(parents=True)
    (top / "include").mkdir()
    nvcc = top / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho fake nvcc\n")
    nvcc.chmod(0o755)
    (top / "include" / "cuda_runtime.h").write_text("")
    if with_cicc:
        (top / "nvvm" / "bin").mkdir(parents=True)
        (top / "nvvm" / "bin" / "cicc").write_text("")


class FakePip:
    """Records pip commands; lays out a toolchain in --target unless told to fail."""

    def __init__(self, check: ModuleType, *, fail: bool = False, complete: bool = True) -> None:
        self.check, self.fail, self.complete = check, fail, complete
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(cmd)
        if self.fail:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="No matching dist")
        target = Path(cmd[cmd.index("--target") + 1])
        _lay_out_toolchain(self.check, target, with_cicc=self.complete)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")


def test_nvcc_on_the_path_is_used_as_it_is(check: ModuleType, tmp_path: Path) -> None:
    pip = FakePip(check)
    found = check.locate_nvcc(tmp_path, which=lambda _: "/opt/cuda/bin/nvcc", run=pip)
    assert found == check.Nvcc(Path("/opt/cuda/bin/nvcc"), "PATH")
    assert pip.calls == [] and list(tmp_path.iterdir()) == []


def test_without_nvcc_the_pinned_wheels_are_installed_once(
    check: ModuleType, tmp_path: Path
) -> None:
    pip = FakePip(check)
    found = check.locate_nvcc(tmp_path, which=lambda _: None, run=pip)
    folder = tmp_path / check.TOOLCHAIN_TAG
    assert found == check.Nvcc(folder / "nvidia/cu13/bin/nvcc", "installed")
    [cmd] = pip.calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in cmd
    packages = [c for c in cmd if c.startswith("nvidia-")]
    names = {p.split("==")[0] for p in packages}
    assert names == {
        "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime",
        "nvidia-cuda-cccl",
    }  # fmt: skip
    assert all("==13.0." in p for p in packages), "one CUDA release, pinned"
    # The next run finds it in the cache and installs nothing; nothing partial is left.
    again = check.locate_nvcc(tmp_path, which=lambda _: None, run=pip)
    assert again == check.Nvcc(found.path, "cache") and len(pip.calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [check.TOOLCHAIN_TAG]


def test_a_failed_install_leaves_nothing_and_says_what_to_do(
    check: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(check.ToolchainError, match="CUDA toolkit's nvcc on the PATH"):
        check.locate_nvcc(tmp_path, which=lambda _: None, run=FakePip(check, fail=True))
    assert list(tmp_path.iterdir()) == []


def test_an_incomplete_toolchain_is_not_taken(check: ModuleType, tmp_path: Path) -> None:
    # cicc (nvvm) is a wheel of its own since CUDA 13: nvcc without it cannot compile.
    with pytest.raises(check.ToolchainError, match="no complete nvcc"):
        check.locate_nvcc(tmp_path, which=lambda _: None, run=FakePip(check, complete=False))
    _lay_out_toolchain(check, tmp_path / "partial", with_cicc=False)
    assert check.cached_nvcc(tmp_path / "partial") is None


def test_no_install_fails_with_a_hint(check: ModuleType, tmp_path: Path) -> None:
    pip = FakePip(check)
    with pytest.raises(check.ToolchainError, match="without --no-install"):
        check.locate_nvcc(tmp_path, install=False, which=lambda _: None, run=pip)
    assert pip.calls == []


def test_the_cache_folder_follows_the_environment(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(check.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert check.default_root() == tmp_path / "xdg" / "kvrelay" / "cuda-toolchain"
    monkeypatch.setenv(check.CACHE_ENV, str(tmp_path / "mine"))
    assert check.default_root() == tmp_path / "mine"


def test_the_script_reports_a_missing_compiler_without_installing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-install", "--toolchain-dir", str(tmp_path)],
        capture_output=True, text=True, check=False, env={**os.environ, "PATH": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "nvcc is not on the PATH" in proc.stderr and "CUDA toolkit" in proc.stderr


def test_a_cached_pypi_compiler_compiles_a_kernel(check: ModuleType, tmp_path: Path) -> None:
    """The real wheels, where an earlier `make kernels-check` without nvcc cached them."""
    nvcc = check.cached_nvcc(check.default_root() / check.TOOLCHAIN_TAG)
    if nvcc is None:
        pytest.skip("no PyPI CUDA toolchain cached here (make kernels-check installs it)")
    _, kernels, error = check.compile_one(
        ROOT / "kernels/csrc/cache_ops.cu", "sm_90", tmp_path, str(nvcc)
    )
    assert error == "", error
    assert kernels and all(k.registers > 0 for k in kernels)
