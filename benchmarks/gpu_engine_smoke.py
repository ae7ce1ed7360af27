#!/usr/bin/env python
"""Part 3 of benchmarks/gpu_check.py alone: the engine end to end on random-weight models
(greedy tokens vs transformers, kernel and CUDA-graph counters, step times, throughput).

    PYTHONPATH=services:kernels python benchmarks/gpu_engine_smoke.py [gpu_check options]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check, gpu_parts beside it

from gpu_check import main as gpu_check_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return gpu_check_main(["--parts", "engine", *args])


if __name__ == "__main__":
    sys.exit(main())
