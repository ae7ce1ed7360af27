"""`make kernels-check`: compile every CUDA kernel with nvcc for each target arch and report
registers, shared memory and spills from ptxas; exit non-zero on any error or spill.

Needs only nvcc (no GPU, no torch): the .cu files are free of ATen headers on purpose. Without
nvcc on the PATH it uses (installing once, with pip) NVIDIA's CUDA compiler wheels from PyPI
in a cache folder: see py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHS = ("sm_80", "sm_90")
FLAGS = ["-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v", "-lineinfo"]

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?(?:, \d+ bytes cmem|$)")

# NVIDIA's CUDA 13.0 compiler as PyPI wheels, versions that ship together (one CUDA release):
# nvcc and ptxas, cicc (nvvm), the crt and runtime headers (cuda_runtime.h, cuda_bf16.h) and
# CCCL. They unpack into one prefix, nvidia/cu13, which nvcc.profile reads as its TOP.
TOOLCHAIN_PACKAGES = (
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
)
TOOLCHAIN_TAG = "cu13.0.88"  # the cache's subfolder: a new pin installs beside the old one
TOOLCHAIN_PREFIX = Path("nvidia", "cu13")
CACHE_ENV = "KVRELAY_CUDA_TOOLCHAIN"


class ToolchainError(RuntimeError):
    """No usable nvcc, and none could be installed."""


@dataclass(frozen=True)
class Nvcc:
    path: Path
    source: str  # "PATH" | "cache" | "installed"


def default_root() -> Path:
    """$KVRELAY_CUDA_TOOLCHAIN, else ~/.cache/kvrelay/cuda-toolchain (XDG_CACHE_HOME honoured)."""
    if override := os.environ.get(CACHE_ENV):
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvrelay" / "cuda-toolchain"


def cached_nvcc(folder: Path) -> Path | None:
    """The nvcc of a complete toolchain in `folder` (cicc and the headers beside it), or None."""
    top = folder / TOOLCHAIN_PREFIX
    nvcc = top / "bin" / "nvcc"
    needed = (nvcc, top / "nvvm" / "bin" / "cicc", top / "include" / "cuda_runtime.h")
    if all(p.is_file() for p in needed) and os.access(nvcc, os.X_OK):
        return nvcc
    return None


def install_toolchain(
    folder: Path, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> None:
    """pip-install TOOLCHAIN_PACKAGES into `folder`, atomically: into a private folder first,
    renamed into place when complete, so an interrupted or concurrent install never leaves a
    half toolchain that `cached_nvcc` would take.

    Raises:
        ToolchainError: pip failed (no network, no such version).
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--target", str(partial), *TOOLCHAIN_PACKAGES]  # fmt: skip
    print(f"kernels-check: installing nvcc from PyPI into {folder} (once)", file=sys.stderr)
    proc = run(cmd, capture_output=True, text=True, check=False)
    try:
        if proc.returncode != 0:
            raise ToolchainError(
                f"pip could not install {' '.join(TOOLCHAIN_PACKAGES)}:\n"
                f"{(proc.stdout + proc.stderr).strip()[-2000:]}\n"
                "put a CUDA toolkit's nvcc on the PATH, or retry with network access"
            )
        try:
            partial.rename(folder)
        except OSError:  # another run finished first: keep its toolchain
            if cached_nvcc(folder) is None:
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def locate_nvcc(
    root: Path | None = None,
    *,
    install: bool = True,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> Nvcc:
    """nvcc from the PATH when there is one (a CUDA toolkit: used as it is); else the PyPI
    toolchain cached under `root` (default_root()), installed there first when `install`.

    Raises:
        ToolchainError: none on the PATH, none cached, and installing is off or failed.
    """
    on_path = which("nvcc")
    if on_path is not None:
        return Nvcc(Path(on_path), "PATH")
    folder = (root or default_root()) / TOOLCHAIN_TAG
    if (nvcc := cached_nvcc(folder)) is not None:
        return Nvcc(nvcc, "cache")
    if not install:
        raise ToolchainError(
            f"nvcc is not on the PATH and {folder} holds no toolchain; install a CUDA toolkit, "
            "or run without --no-install to take nvcc from PyPI"
        )
    install_toolchain(folder, run)
    if (nvcc := cached_nvcc(folder)) is None:
        raise ToolchainError(f"pip installed {folder}, but it has no complete nvcc toolchain")
    return Nvcc(nvcc, "installed")


@dataclass
class KernelInfo:
    name: str
    arch: str
    registers: int = 0
    smem: int = 0
    spill: int = 0


def compile_one(
    source: Path, arch: str, out_dir: Path, nvcc: str = "nvcc"
) -> tuple[str, list[KernelInfo], str]:
    """Compile `source` for `arch` with `nvcc`; returns (label, kernels, error text or '')."""
    out = out_dir / f"{source.stem}.{arch}.o"
    cmd = [nvcc, *FLAGS, f"-arch={arch}", "-c", str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = proc.stdout + proc.stderr
    kernels: list[KernelInfo] = []
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            kernels.append(KernelInfo(m.group(1), m.group(2)))
        elif kernels and (m := _SPILL.search(line)):
            kernels[-1].spill = int(m.group(2)) + int(m.group(3))
        elif kernels and "Used" in line and (m := _USED.search(line)):
            kernels[-1].registers = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            kernels[-1].smem = int(smem.group(1)) if smem else 0
    error = text if proc.returncode != 0 or "error" in text.lower() else ""
    return f"{source.name} [{arch}]", kernels, error


def demangle(names: list[str]) -> list[str]:
    """Readable kernel names (c++filt when present), without namespaces and argument lists."""
    if not names or shutil.which("c++filt") is None:
        return names
    proc = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=False
    )
    lines = proc.stdout.splitlines() if proc.returncode == 0 else names
    short = []
    for line in lines:
        name = line.replace("(anonymous namespace)::", "").replace("kvrelay::", "")
        short.append(re.sub(r"\([^()]*\)$", "", name).replace("void ", ""))
    return short if len(short) == len(names) else names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 2))
    parser.add_argument("--arch", action="append", help="override the target archs")
    parser.add_argument(
        "--toolchain-dir",
        type=Path,
        default=None,
        help="where the PyPI CUDA compiler goes when nvcc is not on the PATH "
        f"(default: ${CACHE_ENV}, else {default_root()})",
    )
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="never pip-install the compiler: fail when neither the PATH nor the cache has one",
    )
    args = parser.parse_args(argv)
    try:
        nvcc = locate_nvcc(root=args.toolchain_dir, install=not args.no_install)
    except ToolchainError as exc:
        print(f"kernels-check: {exc}", file=sys.stderr)
        return 2
    print(f"nvcc: {nvcc.path} ({nvcc.source})")
    archs = args.arch or list(ARCHS)
    sources = sorted(HERE.glob("*.cu"))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [
            pool.submit(compile_one, s, a, Path(tmp), str(nvcc.path))
            for s in sources
            for a in archs
        ]
        results = [j.result() for j in jobs]
    failed = False
    rows: list[KernelInfo] = []
    for label, kernels, error in results:
        if error:
            failed = True
            print(f"ERROR compiling {label}:\n{error}", file=sys.stderr)
        rows.extend(kernels)
    names = demangle([k.name for k in rows])
    width = max([len(n) for n in names] + [6])
    print(f"{'kernel':<{width}}  arch    regs   smem(B)  spill(B)")
    for name, k in sorted(zip(names, rows, strict=True), key=lambda r: (r[0], r[1].arch)):
        flag = "  <-- SPILL" if k.spill else ""
        print(f"{name:<{width}}  {k.arch:<6} {k.registers:>5} {k.smem:>9} {k.spill:>9}{flag}")
    spills = [k for k in rows if k.spill]
    print(
        f"{len(rows)} kernels from {len(sources)} files x {len(archs)} archs; "
        f"{len(spills)} spilling; {'FAILED' if failed else 'errors: none'}"
    )
    if not rows:
        print("kernels-check: ptxas reported no kernels", file=sys.stderr)
        return 1
    return 1 if failed or spills else 0


if __name__ == "__main__":
    sys.exit(main())
