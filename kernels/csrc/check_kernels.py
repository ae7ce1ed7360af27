"""`make kernels-check`: compile every CUDA kernel with nvcc for each target arch and report
registers, shared memory and spills from ptxas; exit non-zero on any error or spill.

Needs only nvcc (no GPU, no torch): the .cu files are free of ATen headers on purpose.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHS = ("sm_80", "sm_90")
FLAGS = ["-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v", "-lineinfo"]

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?(?:, \d+ bytes cmem|$)")


@dataclass
class KernelInfo:
    name: str
    arch: str
    registers: int = 0
    smem: int = 0
    spill: int = 0


def compile_one(source: Path, arch: str, out_dir: Path) -> tuple[str, list[KernelInfo], str]:
    """Compile `source` for `arch`; returns (label, kernels, error text or '')."""
    out = out_dir / f"{source.stem}.{arch}.o"
    cmd = ["nvcc", *FLAGS, f"-arch={arch}", "-c", str(source), "-o", str(out)]
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
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("kernels-check: nvcc not found on PATH", file=sys.stderr)
        return 2
    archs = args.arch or list(ARCHS)
    sources = sorted(HERE.glob("*.cu"))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(compile_one, s, a, Path(tmp)) for s in sources for a in archs]
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
