"""What a real API server does to one of our custom resources before it stores it, for the
fake API server: structural defaulting, pruning of unknown fields (refused instead under
`fieldValidation=Strict`), the openAPIV3Schema's checks (types, required, enums, patterns,
bounds) and its CEL rules (`x-kubernetes-validations`, evaluated with cel-python, transition
rules with `oldSelf` on updates only). Updates ratchet as Kubernetes 1.30+ does
(CRDValidationRatcheting): a value an update leaves unchanged is not checked again, so an
object stored before a rule tightened can still have its status written.

Only the CRDs the chart ships (kvrelay.io, kopf.dev); other kinds pass unchecked.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Any

import celpy
import jsonschema

from tests.deploy.schemas import apply_defaults, crds

Obj = dict[str, Any]
_PATH = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/(namespaces/[^/]+/)?(?P<plural>[^/]+)"
)
# Never pruned: the API server handles these itself.
_ROOT_KEEP = ("apiVersion", "kind", "metadata")


class Refused(Exception):
    """What the API server answers instead: an HTTP status and a Status message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def body(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": self.reason,
            "code": self.status,
            "message": self.message,
        }


@cache
def _schemas() -> dict[tuple[str, str], tuple[str, Obj]]:
    """(group, plural) -> (kind, openAPIV3Schema) of every CRD the chart installs."""
    out = {}
    for kind, crd in crds().items():
        names = crd["spec"]["names"]
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        out[(crd["spec"]["group"], names["plural"])] = (kind, schema)
    return out


def schema_for(path: str) -> tuple[str, Obj] | None:
    """The kind and schema of the custom resource at REST `path`; None for other kinds."""
    match = _PATH.match(path)
    if match is None:
        return None
    return _schemas().get((match["group"], match["plural"]))


def prune(schema: Obj, value: Any, at: str = "") -> tuple[Any, list[str]]:
    """`value` without the fields `schema` does not know, and their paths."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value, []
    dropped: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        out = {}
        for key, sub in value.items():
            if key in schema["properties"]:
                out[key], more = prune(schema["properties"][key], sub, f"{at}.{key}")
                dropped += more
            elif at == "" and key in _ROOT_KEEP:
                out[key] = sub
            else:
                dropped.append(f"{at}.{key}")
        return out, dropped
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        out = {}
        for key, sub in value.items():
            out[key], more = prune(schema["additionalProperties"], sub, f"{at}.{key}")
            dropped += more
        return out, dropped
    if isinstance(value, list) and "items" in schema:
        items = [prune(schema["items"], v, f"{at}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], [p for _, more in items for p in more]
    return value, []


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _rule_nodes(schema: Obj, value: Any, old: Any, at: str) -> list[tuple[Obj, Any, Any, str]]:
    """Every (schema node, value, old value, path) where `value` has the node."""
    found = [(schema, value, old, at)]
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                prior = old.get(key) if isinstance(old, dict) else None
                found += _rule_nodes(sub, value[key], prior, f"{at}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += _rule_nodes(schema["items"], item, None, f"{at}[{i}]")
    return found


def cel_failures(schema: Obj, value: Obj, old: Obj | None) -> list[str]:
    """'path: message' of every CEL rule `value` breaks (transition rules against `old`)."""
    out = []
    for node, sub, prior, at in _rule_nodes(schema, value, old, ""):
        for rule in node.get("x-kubernetes-validations", ()):
            transition = "oldSelf" in rule["rule"]
            if transition and prior is None:
                continue  # a create, or a field that is new: the server skips these
            if prior is not None and prior == sub and not transition:
                continue  # ratcheting: unchanged since the stored object
            bound = {"self": celpy.json_to_cel(sub)}
            if transition:
                bound["oldSelf"] = celpy.json_to_cel(prior)
            try:
                ok = bool(_program(rule["rule"]).evaluate(bound))
                message = rule.get("message", f"failed rule: {rule['rule']}")
            except Exception as exc:  # a runtime error in a rule refuses the object too
                ok, message = False, f"rule {rule['rule']!r} could not be evaluated: {exc}"
            if not ok:
                out.append(f"{at or '<root>'}: Invalid value: {message}")
    return out


def _unchanged(path: Any, value: Any, old: Any) -> bool:
    """Whether the value at `path` is what the stored object has (ratcheting)."""
    if old is None:
        return False
    for key in path:
        try:
            value, old = value[key], old[key]
        except (KeyError, IndexError, TypeError):
            return False
    return bool(value == old)


def admit(path: str, obj: Obj, old: Obj | None, strict: bool) -> Obj:
    """`obj` as the server would store it at `path`: defaulted and pruned.

    Raises:
        Refused: 422 Invalid, as the server answers an object its CRD refuses.
    """
    found = schema_for(path)
    if found is None:
        return obj
    kind, schema = found
    name = (obj.get("metadata") or {}).get("name", "")
    pruned, dropped = prune(schema, copy.deepcopy(obj))
    if dropped and strict:
        raise Refused(422, "Invalid", f'{kind} "{name}" is invalid: unknown fields {dropped}')
    value = apply_defaults(schema, pruned)
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(value)
        if not _unchanged(e.absolute_path, value, old)
    ]
    errors += cel_failures(schema, value, old)
    if errors:
        raise Refused(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(errors))
    result: Obj = value
    return result
