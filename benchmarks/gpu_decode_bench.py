#!/usr/bin/env python
"""Part 2 of benchmarks/gpu_check.py alone: decode attention as % of copy bandwidth (the code
lives in gpu_parts/decode_bench.py; its names are re-exported here for older callers).

    PYTHONPATH=services:kernels python benchmarks/gpu_decode_bench.py [gpu_check options]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check, gpu_parts beside it

from gpu_check import main as gpu_check_main
from gpu_parts.decode_bench import (
    METHODS,
    MODELS,
    Result,
    Shape,
    check_targets,
    format_table,
    paged_block_mask,
    shapes,
)

__all__ = [
    "METHODS", "MODELS", "Result", "Shape", "check_targets", "format_table", "paged_block_mask",
    "shapes",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return gpu_check_main(["--parts", "decode", *args])


if __name__ == "__main__":
    sys.exit(main())
