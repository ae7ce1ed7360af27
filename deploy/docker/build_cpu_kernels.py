"""Build kvrelay's CPU kernels into the image (the Dockerfile's CPU stage), so a pod on a
node like the build machine loads them instead of compiling at start.

Calls every loader of a `kvrelay_kernels` CPU extension (each builds on first call, with
torch's cpp_extension, into $TORCH_EXTENSIONS_DIR) and fails if any could not be built.
The builds use -march=native and are keyed on the CPU's feature flags
(`kvrelay_kernels.cpu_extension.build_name`): a node whose CPU has other flags builds its
own on first use (the image keeps g++ and ninja for that).

    TORCH_EXTENSIONS_DIR=/opt/torch_extensions python build_cpu_kernels.py

`make test` runs it too (`--jobs 2`), before pytest: each build is one g++ process, so two at
a time halve the wait on two cores, and no test or server start pays a compile inside its own
timeout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from concurrent.futures import ProcessPoolExecutor

# (module, loader) of every CPU extension; tests/operator/test_operator_image.py checks
# this names every caller of load_cpu_extension.
LOADERS = (
    ("kvrelay_kernels.cpu_backend", "load_extension"),
    ("kvrelay_kernels.cpu_blocked", "load_blocked_ops"),
    ("kvrelay_kernels.cpu_fused", "load_fused_ops"),
    ("kvrelay_kernels.cpu_prefill", "load_extension"),
    ("kvrelay_kernels.cpu_quantized", "load_block_quant_ops"),
    ("kvrelay_kernels.cpu_quantized", "load_int8_dot_ops"),
    ("kvrelay_kernels.cpu_stack", "load_stack_ops"),
)


def build(module: str, loader: str) -> bool:
    """Build (or find built) one extension, in this process; whether it loaded."""
    return getattr(importlib.import_module(module), loader)() is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build kvrelay's CPU kernels ahead of use.")
    parser.add_argument(
        "--jobs", type=int, default=1, help="builds at a time, each in its own process"
    )
    jobs = max(1, parser.parse_args(argv).jobs)
    where = os.environ.get("TORCH_EXTENSIONS_DIR", "torch's default")
    failed = []
    with ProcessPoolExecutor(jobs) as pool:  # processes: each build is one g++ run
        results = pool.map(build, *zip(*LOADERS, strict=True))
        for (module, loader), built in zip(LOADERS, results, strict=True):
            print(f"{module}.{loader}: {'ok' if built else 'FAILED'}", flush=True)
            if not built:
                failed.append(f"{module}.{loader}")
    if failed:
        print(f"could not build {', '.join(failed)} into {where}", file=sys.stderr)
        return 1
    print(f"CPU kernels built into {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
