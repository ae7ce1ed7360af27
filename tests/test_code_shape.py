"""The code stays in shape: no source file over 500 lines, no function over 60 lines (a schema
literal aside), and the router process does not import torch.

The 500-line rule covers the Python sources, the kernels' C++ and CUDA files and the tests; the
60-line rule the Python sources (tests' functions are not measured). Generated protobuf code is
skipped.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("services", "kernels", "operators", "benchmarks")
NATIVE_SUFFIXES = (".cpp", ".cu", ".cuh", ".h")  # under kernels/
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _is_generated(path: Path) -> bool:
    return path.parent.name == "v1" and path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


def _source_files() -> Iterator[Path]:
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not _is_generated(path):
                yield path


def _sized_files() -> Iterator[Path]:
    """What the 500-line rule covers: the Python sources, the kernels' C++ / CUDA sources and
    headers, and the tests (benchmarks/*.py are Python sources already)."""
    yield from _source_files()
    for path in sorted((ROOT / "kernels").rglob("*")):
        if path.suffix in NATIVE_SUFFIXES and path.is_file():
            yield path
    yield from sorted((ROOT / "tests").rglob("*.py"))


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first decorator to the end of the body."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    assert node.end_lineno is not None
    return node.end_lineno - first + 1


def _is_literal(node: ast.expr) -> bool:
    """A data literal: dicts, lists, tuples, constants, and calls whose arguments are all
    literals (e.g. `dict(type="object", ...)` or a small schema helper)."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Dict):
        keys_ok = all(k is None or _is_literal(k) for k in node.keys)
        return keys_ok and all(_is_literal(v) for v in node.values)
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.Starred):
        return _is_literal(node.value)
    if isinstance(node, ast.Name | ast.Attribute):
        return True  # a named constant or a reference to another schema part
    if isinstance(node, ast.Call):
        args = [*node.args, *(k.value for k in node.keywords)]
        return all(_is_literal(a) for a in args)
    return False


def _is_schema_literal(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A body of an optional docstring and one `return <dict or list literal>`."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return False
    value = body[0].value
    return isinstance(value, ast.Dict | ast.List) and _is_literal(value)


def test_no_source_file_is_over_500_lines() -> None:
    offenders = []
    for path in _sized_files():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            offenders.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not offenders, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(offenders)


def test_the_file_rule_sees_native_sources_and_tests() -> None:
    sized = {path.relative_to(ROOT).as_posix() for path in _sized_files()}
    assert "kernels/kvrelay_kernels/csrc_cpu/int8_dot_matmul.cpp" in sized
    assert "kernels/kvrelay_kernels/csrc_cpu/kernel_api.h" in sized
    assert any(p.startswith("kernels/csrc/") and p.endswith(".cu") for p in sized)
    assert "tests/test_code_shape.py" in sized
    assert "benchmarks/serve_compare.py" in sized


def test_no_function_is_over_60_lines() -> None:
    offenders = []
    for path in _source_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _functions(tree):
            length = _length(node)
            if length <= MAX_FUNCTION_LINES:
                continue
            if _is_schema_literal(node):
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_the_schema_literal_detection() -> None:
    schema = ast.parse('def f():\n    """Doc."""\n    return {"a": [1, {"b": X}], **BASE}\n')
    logic = ast.parse("def f():\n    x = 1\n    return {'a': x}\n")
    computed = ast.parse("def f():\n    return {'a': [y for y in range(3)]}\n")
    assert _is_schema_literal(next(_functions(schema)))
    assert not _is_schema_literal(next(_functions(logic)))
    assert not _is_schema_literal(next(_functions(computed)))


@pytest.mark.parametrize(
    "module",
    [
        "kvrelay.router.router",  # the router's process stays light
        "kvrelay.cli",  # `kvrelay --help` and `kvrelay operator` answer at once
    ],
)
def test_light_modules_do_not_import_torch(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    torch_modules = [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert not torch_modules, f"{module} imports torch: {torch_modules[:5]}"
