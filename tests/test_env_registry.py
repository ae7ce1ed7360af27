"""Every `KVRELAY_*` environment variable is declared once, in its package's registry, and
docs/operations.md lists each: kvrelay's in `kvrelay.common.env`, the kernels' in
`kvrelay_kernels.env` (the lower layer cannot import kvrelay), the operator's in
`kvrelay_operator.env` (it imports neither kvrelay nor torch). No other module of the three
packages spells a name: it imports the registry's declaration (or a constant made from it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvrelay.common import env as kvrelay_env
from kvrelay_kernels import env as kernels_env
from kvrelay_operator import env as operator_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services/kvrelay", "kernels/kvrelay_kernels", "operators/kvrelay_operator")
REGISTRIES = (
    "services/kvrelay/common/env.py",
    "kernels/kvrelay_kernels/env.py",
    "operators/kvrelay_operator/env.py",
)
# Files another change is rewriting now; each still spells a name it should take from
# kvrelay.common.env. Remove an entry once its file imports the registry instead (the test
# fails on an entry whose file no longer needs it).
ALLOWED = {
    "services/kvrelay/common/messages.py",  # GENERATION_ENV, POD_NAME_ENV, NODE_NAME_ENV
    "services/kvrelay/worker/engine_builder.py",  # ENGINE_ARGS_ENV
}
NAME = re.compile(r"KVRELAY_[A-Z0-9_]*")
DOCS = ROOT / "docs" / "operations.md"
TABLE_HEADER = "| variable | type | default | what it does |\n|---|---|---|---|\n"


def _is_generated(path: Path) -> bool:
    return path.parent.name == "v1" and path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


def _spelled_names(path: Path) -> list[str]:
    """The string literals in `path` that are a `KVRELAY_*` name (prose naming one is not)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and NAME.fullmatch(node.value)
    ]


def _offenders() -> dict[str, list[str]]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative in REGISTRIES or _is_generated(path):
                continue
            if names := _spelled_names(path):
                found[relative] = names
    return found


def registry_table() -> str:
    """docs/operations.md's table of the variables, as the registries declare them."""
    entries = [*kvrelay_env.REGISTRY, *kernels_env.REGISTRY, *operator_env.REGISTRY]
    rows = [f"| `{v.name}` | {v.type} | {v.shown_default()} | {v.meaning} |" for v in entries]
    return TABLE_HEADER + "\n".join(rows) + "\n"


def test_no_module_spells_a_variable_name_outside_the_registries() -> None:
    found = _offenders()
    spelled = {path: names for path, names in found.items() if path not in ALLOWED}
    assert not spelled, "declare these in the package's env registry and import them:\n" + (
        "\n".join(f"{path}: {names}" for path, names in spelled.items())
    )
    stale = sorted(ALLOWED - found.keys())
    assert not stale, f"these no longer spell a name: remove them from ALLOWED: {stale}"


def test_the_check_sees_a_spelled_name(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text('"""Reads $KVRELAY_X."""\nimport os\nos.environ.get("KVRELAY_X")\n')
    assert _spelled_names(source) == ["3: 'KVRELAY_X'"]


def test_each_name_is_declared_once() -> None:
    names = [
        *(v.name for v in kvrelay_env.REGISTRY),
        *(v.name for v in kernels_env.REGISTRY),
        *(v.name for v in operator_env.REGISTRY),
        *operator_env.LABELS,
    ]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(NAME.fullmatch(n) for n in names)
    for module in (kvrelay_env, kernels_env, operator_env):
        assert len(module.REGISTRY) == len({v.name for v in module.REGISTRY})


def test_the_operator_sets_only_names_kvrelay_reads() -> None:
    """The operator's constants and kvrelay's registry agree on every name they share."""
    read_by_kvrelay = {v.name for v in kvrelay_env.REGISTRY}
    assert set(operator_env.SHARED) <= read_by_kvrelay
    assert not set(operator_env.LABELS) & read_by_kvrelay


def test_docs_list_every_variable_as_the_registries_declare_it() -> None:
    text = DOCS.read_text()
    for module in (kvrelay_env, kernels_env, operator_env):
        for var in module.REGISTRY:
            assert f"| `{var.name}` |" in text, f"{var.name} is not in {DOCS.name}"
    table = registry_table()
    assert table in text, f"replace the table in {DOCS.name} with:\n{table}"


def test_a_read_happens_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    var = kvrelay_env.CPU_QUANT_KERNEL
    monkeypatch.delenv(var.name, raising=False)
    assert var.get() == "auto"
    monkeypatch.setenv(var.name, "torch")
    assert var.get() == "torch"
    assert var.get({var.name: "x"}) == "x" and var.get({}) == "auto"
    assert kernels_env.HUGE_PAGES.get({}) == "1" and operator_env.PEERING.get({}) == "kvrelay"


if __name__ == "__main__":  # prints the table for docs/operations.md
    print(registry_table(), end="")
