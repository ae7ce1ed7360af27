"""Build hook: the wheel ships the CUDA kernel sources as `kvrelay_kernels/csrc`.

The sources live in `kernels/csrc` (outside the package, so `make kernels-check` and the
editable install read them in place); `kvrelay_kernels.cuda_backend.csrc_dir()` looks for them
beside the package first and inside it second, so an installed wheel JIT-builds from here.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "kernels" / "csrc"
# What the JIT build reads (kvrelay_kernels.cuda_backend.sources and its includes).
CSRC_PATTERNS = ("*.cu", "*.cuh", "*.h", "*.cpp")


class BuildPyWithCudaSources(build_py):
    """`build_py` that also copies kernels/csrc into the built kvrelay_kernels package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads kernels/csrc where it is
        target = Path(self.build_lib) / "kvrelay_kernels" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for pattern in CSRC_PATTERNS:
            for source in sorted(CSRC.glob(pattern)):
                shutil.copy2(source, target / source.name)


setup(cmdclass={"build_py": BuildPyWithCudaSources})
