"""The layers import downward only (docs/architecture.md section 1): the router and the
shared types never load the engine's or the workers' modules, so a router process runs
without torch's engine and a change inside the engine cannot reach the router's imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "services" / "kvrelay"


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _offenders(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE.parent)} imports {module}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for module in sorted(_imported_modules(path))
        if module.startswith(forbidden)
    ]


def test_the_router_imports_neither_engine_nor_workers() -> None:
    offenders = _offenders("router", ("kvrelay.engine", "kvrelay.worker"))
    assert not offenders, "move what the router needs into kvrelay.common:\n" + "\n".join(offenders)


def test_the_shared_types_import_no_other_layer() -> None:
    layers = ("kvrelay.engine", "kvrelay.worker", "kvrelay.router", "kvrelay.api")
    offenders = _offenders("common", (*layers, "kvrelay.models", "kvrelay.transfer"))
    assert not offenders, "\n".join(offenders)


def test_loading_every_router_module_loads_no_engine_module() -> None:
    """The transitive check: what the router's imports import, at import time."""
    modules = sorted(
        "kvrelay.router." + p.stem
        for p in (PACKAGE / "router").glob("*.py")
        if p.stem != "__init__"
    )
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m.startswith(('kvrelay.engine', "
        "'kvrelay.worker'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]", f"router modules loaded {loaded}"


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The AST walk finds function-local imports too (the kind the router once used)."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from kvrelay.engine.args import EngineArgs\n")
    assert "kvrelay.engine.args" in _imported_modules(source)
