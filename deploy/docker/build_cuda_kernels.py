"""Build kvrelay's CUDA kernels ahead of time (the Dockerfile's CUDA stage).

Compiles the torch binding of kernels/csrc (the sources the installed `kvrelay_kernels`
package ships as `kvrelay_kernels/csrc`) into the importable extension module
`kvrelay_cuda_kernels` in OUT_DIR (the image's site-packages), with torch's own
cpp_extension, so pods never compile at start and need no nvcc. The name and the sources
are the JIT build's (`kvrelay_kernels.cuda_backend`), so both builds are the same module.

Needs nvcc (CUDA_HOME) matching torch's CUDA major version, and no GPU: the target
architectures come from TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0"), which the Dockerfile sets.

    python build_cuda_kernels.py OUT_DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# The module name `kvrelay_kernels.cuda_backend` builds and loads (its _NAME).
MODULE = "kvrelay_cuda_kernels"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the extension module goes")
    args = parser.parse_args(argv)
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        print("set TORCH_CUDA_ARCH_LIST (no GPU here to ask), e.g. '8.0;9.0'", file=sys.stderr)
        return 2

    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    from kvrelay_kernels import cuda_backend

    if cuda_backend._NAME != MODULE:
        print(f"cuda_backend loads {cuda_backend._NAME!r}, not {MODULE!r}", file=sys.stderr)
        return 2
    folder = cuda_backend.csrc_dir()
    extension = CUDAExtension(
        MODULE,
        sources=[str(s) for s in cuda_backend.sources()],
        include_dirs=[str(folder)],
        # The JIT build's flags (cuda_backend._build).
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]},
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as build_temp:
        setup(
            name=MODULE,
            ext_modules=[extension],
            cmdclass={"build_ext": BuildExtension},
            script_args=[
                "build_ext",
                "--build-lib",
                str(args.out_dir),
                "--build-temp",
                build_temp,
            ],
        )
    built = sorted(args.out_dir.glob(f"{MODULE}*.so"))
    if not built:
        print(f"no {MODULE}*.so in {args.out_dir}", file=sys.stderr)
        return 1
    print(f"built {built[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
