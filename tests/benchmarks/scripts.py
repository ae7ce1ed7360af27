"""Loading a script (a benchmark, `make kernels-check`'s checker) as a module for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """`path` imported as the module named after its stem, registered in sys.modules (its
    dataclasses look their module up there); the script's folder is on sys.path while it
    loads, for its own imports (benchmarks/serving, ...)."""
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)
