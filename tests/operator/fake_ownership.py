"""Server-side apply's field ownership, for the fake API server: who set which field, shown
as `metadata.managedFields` in the API's own FieldsV1 form, and the 409 Conflict an apply
gets for changing a field another manager owns unless it forces.

A field an apply stops sending is removed when no other manager owns it, as the real server
does (`released`). Simplified where the operator's tests do not depend on more: a list is one
field (the real server merges lists keyed by name field by field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.operator.fake_schema import Refused

Obj = dict[str, Any]
Path = tuple[str, ...]
# (manager, operation, subresource): one managedFields entry.
Entry = tuple[str, str, str]
_NOT_FIELDS = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}


def leaf_paths(value: Any, prefix: Path = ()) -> set[Path]:
    """The fields `value` sets: each path to a scalar, a list or an empty object."""
    if isinstance(value, dict) and value:
        out: set[Path] = set()
        for key, sub in value.items():
            out |= leaf_paths(sub, (*prefix, str(key)))
        return out
    return {prefix} if prefix else set()


def _lookup(obj: Any, path: Path) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return False, None
        obj = obj[key]
    return True, obj


def remove(obj: Obj, leaf: Path) -> None:
    """Delete `leaf` from `obj`, and the objects it leaves empty."""
    parents = [obj]
    for key in leaf[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(leaf[-1], None)
    for depth in range(len(leaf) - 1, 0, -1):
        if parents[depth]:
            break
        parents[depth - 1].pop(leaf[depth - 1], None)


def fields_v1(paths: set[Path]) -> Obj:
    """`paths` as the API's FieldsV1: {"f:spec": {"f:replicas": {}}}."""
    out: Obj = {}
    for path in sorted(paths):
        node = out
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return out


@dataclass
class Ownership:
    """Field owners of every stored object, by REST path."""

    owners: dict[str, dict[Entry, set[Path]]] = field(default_factory=dict)

    def apply(
        self, path: str, current: Obj | None, body: Obj, manager: str, force: bool
    ) -> set[Path]:
        """Record `manager`'s apply of `body`; the fields it released (sent before, not now,
        owned by no one else), which the server removes. Raises Refused (409) on a conflict."""
        applied = leaf_paths(body) - _NOT_FIELDS
        entries = self.owners.setdefault(path, {})
        conflicts = []
        for entry, owned in entries.items():
            if entry[0] == manager:
                continue
            for leaf in applied & owned:
                _, old = _lookup(current or {}, leaf)
                _, new = _lookup(body, leaf)
                if old != new:
                    conflicts.append((entry[0], leaf))
        if conflicts and not force:
            listed = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
            raise Refused(
                409, "Conflict", f"Apply failed with {len(conflicts)} conflicts: {listed}"
            )
        for _, leaf in conflicts:  # forced: the fields move to `manager`
            for owned in entries.values():
                owned.discard(leaf)
        before = entries.get((manager, "Apply", ""), set())
        entries[(manager, "Apply", "")] = applied
        others = set().union(*(o for e, o in entries.items() if e != (manager, "Apply", "")))
        self._drop_empty(path)
        return {leaf for leaf in before - applied if leaf not in others}

    def update(self, path: str, patch: Obj, manager: str, subresource: str = "") -> None:
        """Record an update (create, merge patch, status, scale): it takes the fields it sets
        from whoever owned them, never a conflict."""
        changed = leaf_paths(patch) - _NOT_FIELDS
        entries = self.owners.setdefault(path, {})
        for owned in entries.values():
            owned -= changed
        entries.setdefault((manager, "Update", subresource), set()).update(changed)
        self._drop_empty(path)

    def _drop_empty(self, path: str) -> None:
        entries = self.owners[path]
        for entry in [e for e, owned in entries.items() if not owned]:
            del entries[entry]

    def managed_fields(self, path: str, api_version: str) -> list[Obj]:
        out = []
        for (manager, operation, subresource), owned in sorted(self.owners.get(path, {}).items()):
            entry: Obj = {
                "manager": manager,
                "operation": operation,
                "apiVersion": api_version,
                "fieldsType": "FieldsV1",
                "fieldsV1": fields_v1(owned),
            }
            if subresource:
                entry["subresource"] = subresource
            out.append(entry)
        return out

    def forget(self, path: str) -> None:
        self.owners.pop(path, None)
