"""The CRDs: current with their generator, valid, structural; custom resources that fit
them pass and those that do not are rejected."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from kvrelay_operator.crds import CRD_FILES, render_yaml
from kvrelay_operator.desired import desired_pool
from tests.deploy.schemas import (
    CRD_DIR,
    KUBE_VERSIONS,
    apply_defaults,
    crd_schema,
    crds,
    validate_custom,
)
from tests.operator.services import service

# Keywords that may not appear inside anyOf / allOf / oneOf / not of a structural schema.
_NOT_IN_VALUE_VALIDATION = {"type", "default", "additionalProperties", "description", "nullable"}


def structural_violations(schema: dict[str, Any], path: str = "", root: bool = True) -> list[str]:
    """The rules of a structural schema that `schema` breaks (Kubernetes' definition)."""
    problems = []
    special = schema.get("x-kubernetes-int-or-string") or schema.get(
        "x-kubernetes-preserve-unknown-fields"
    )
    if "type" not in schema and not special:
        problems.append(f"{path or '/'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: properties and additionalProperties together")
    for keyword in ("anyOf", "allOf", "oneOf"):
        for branch in schema.get(keyword, ()):
            int_or_string = schema.get("x-kubernetes-int-or-string") and branch in (
                {"type": "integer"},
                {"type": "string"},
            )
            if not int_or_string and _NOT_IN_VALUE_VALIDATION & branch.keys():
                problems.append(
                    f"{path}.{keyword}: sets {_NOT_IN_VALUE_VALIDATION & branch.keys()}"
                )
    if "default" in schema:
        try:
            jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, schema["default"]))
        except jsonschema.ValidationError as exc:
            problems.append(f"{path}: default does not validate: {exc.message}")
    for name, sub in (schema.get("properties") or {}).items():
        if root and name == "metadata" and set(sub) != {"type"}:
            problems.append("metadata: only its type may be given at the root")
        problems += structural_violations(sub, f"{path}.{name}", root=False)
    for key in ("items", "additionalProperties"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            problems += structural_violations(sub, f"{path}[{key}]", root=False)
    if schema.get("x-kubernetes-list-type") == "map":
        item = schema["items"]
        for key in schema["x-kubernetes-list-map-keys"]:
            if key not in item.get("required", ()) and "default" not in item["properties"][key]:
                problems.append(f"{path}: list-map key {key} must be required or defaulted")
    return problems


def test_chart_crds_are_generated_from_the_operator() -> None:
    for filename, build in CRD_FILES.items():
        assert (CRD_DIR / filename).read_text() == render_yaml(build()), (
            f"regenerate: python -m kvrelay_operator.crds {CRD_DIR}"
        )


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("kind", ["KVRelayService", "KVRelayPool"])
def test_crds_validate_strictly(kind: str, version: str) -> None:
    kubernetes_validate.validate(crds()[kind], version, strict=True)


@pytest.mark.parametrize("kind", ["KVRelayService", "KVRelayPool"])
def test_crds_are_structural(kind: str) -> None:
    assert structural_violations(crd_schema(kind)) == []


def test_structural_check_catches_violations() -> None:
    bad = {
        "type": "object",
        "properties": {
            "a": {"description": "no type"},
            "b": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
            "c": {"type": "integer", "minimum": 1, "default": 0},
            "d": {"type": "string", "anyOf": [{"type": "string", "default": "x"}]},
        },
    }
    assert len(structural_violations(bad)) == 4


def _json_path_exists(schema: dict[str, Any], path: str) -> bool:
    node = schema
    for part in re.sub(r"\[\?.*?\]", "", path).strip(".").split("."):
        props = node.get("properties") or {}
        if part not in props:
            # Conditions are an array of objects: the filter picks one item.
            items = node.get("items") or {}
            props = items.get("properties") or {}
            if part not in props:
                return False
        node = props[part]
    return True


@pytest.mark.parametrize("kind", ["KVRelayService", "KVRelayPool"])
def test_printer_columns_and_scale_paths_point_into_the_schema(kind: str) -> None:
    version = crds()[kind]["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".metadata"):
            continue
        assert _json_path_exists(schema, path), path
    scale = version["subresources"].get("scale")
    if kind == "KVRelayPool":
        assert scale is not None
        for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
            assert _json_path_exists(schema, scale[key]), key
        assert _json_path_exists(schema, ".status.selector")
        status = schema["properties"]["status"]["properties"]
        assert status["selector"]["type"] == "string"  # HPA reads a string selector
    else:
        assert scale is None


def _service(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvrelay.io/v1alpha1",
        "kind": "KVRelayService",
        "metadata": {"name": "demo"},
        "spec": spec,
    }


VALID_SERVICES = {
    "empty": {},
    "pvc": {"model": {"source": "pvc", "pvc": {"claimName": "models", "path": "a/b"}}},
    "autoscaled": {
        "prefill": {"autoscaling": {"enabled": True, "target": "250ms", "maxReplicas": 8}},
        "decode": {"autoscaling": {"enabled": True, "metric": "kvUsage", "target": "0.75"}},
    },
    "router": {
        "router": {"replicas": 3, "serviceType": "LoadBalancer", "apiKeySecret": {"name": "s"}},
        "kvTransfer": {"backend": "grpc"},
        "engineArgs": ["--block-size=32", "--no-prefix-caching"],
    },
    "placement": {
        "decode": {
            "resources": {"requests": {"cpu": "500m", "memory": "8Gi"}, "limits": {"cpu": 2}},
            "tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute"}],
            "nodeSelector": {"zone": "a"},
        }
    },
}


@pytest.mark.parametrize("case", sorted(VALID_SERVICES))
def test_valid_services(case: str) -> None:
    defaulted = validate_custom(_service(VALID_SERVICES[case]))
    spec = defaulted["spec"]
    assert spec["kvTransfer"]["backend"] in ("nixl", "grpc")
    assert spec["prefill"]["autoscaling"]["metric"] == "ttft"
    assert spec["decode"]["replicas"] == 1


def test_defaults_fill_an_empty_spec() -> None:
    spec = validate_custom(_service({}))["spec"]
    assert spec["model"]["source"] == "default"
    assert spec["router"] == {"replicas": 2, "serviceType": "ClusterIP"}
    assert spec["decode"]["autoscaling"]["target"] == "100ms"
    assert spec["monitoring"]["serviceMonitor"]["enabled"] is False


def _set(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


INVALID_SERVICES = [
    ("bad transfer enum", "kvTransfer.backend", "rdma"),
    ("bad model source", "model.source", "s3"),
    ("bad service type", "router.serviceType", "Ingress"),
    ("replicas wrong type", "prefill.replicas", "two"),
    ("replicas negative", "decode.replicas", -1),
    ("router replicas zero", "router.replicas", 0),
    ("decode metric for prefill", "prefill.autoscaling.metric", "kvUsage"),
    ("bad target", "decode.autoscaling.target", "fast"),
    ("percentile too high", "prefill.autoscaling.percentile", 100),
    ("engine arg not a flag", "engineArgs", ["max-num-seqs=4"]),
    ("bad quantity", "prefill.resources.requests", {"cpu": "lots"}),
    ("bad toleration operator", "decode.tolerations", [{"operator": "Maybe"}]),
    ("missing claimName", "model.pvc", {"path": "x"}),
    ("missing secret name", "router.apiKeySecret", {"key": "k"}),
    ("unknown field", "router.replica", 2),
]


@pytest.mark.parametrize(
    ("path", "value"), [c[1:] for c in INVALID_SERVICES], ids=[c[0] for c in INVALID_SERVICES]
)
def test_invalid_services_are_rejected(path: str, value: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(_service(_set({}, path, value)))


def test_missing_spec_is_rejected() -> None:
    with pytest.raises(jsonschema.ValidationError, match="spec"):
        validate_custom({"apiVersion": "kvrelay.io/v1alpha1", "kind": "KVRelayService"})


@pytest.mark.parametrize(
    ("spec", "ok"),
    [
        ({"service": "demo", "pool": "decode", "replicas": 3}, True),
        ({"service": "demo", "pool": "prefill"}, True),
        ({"service": "demo", "pool": "colocated"}, False),
        ({"pool": "decode"}, False),
        ({"service": "demo", "pool": "decode", "replicas": "3"}, False),
    ],
)
def test_pools(spec: dict[str, Any], ok: bool) -> None:
    obj = {"apiVersion": "kvrelay.io/v1alpha1", "kind": "KVRelayPool", "metadata": {}, "spec": spec}
    if ok:
        assert validate_custom(obj)["spec"]["replicas"] >= 0
    else:
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(obj)


def test_generated_pools_validate() -> None:
    for pool in ("prefill", "decode"):
        validate_custom(desired_pool(service({}), pool, 2))


def test_cel_rules_name_only_fields_of_their_node() -> None:
    """CEL is not evaluated here; at least each rule's `self.x` exists where it is attached."""

    def walk(node: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
        found = [(node, r["rule"]) for r in node.get("x-kubernetes-validations", ())]
        for sub in (node.get("properties") or {}).values():
            found += walk(sub)
        return found

    rules = walk(crd_schema("KVRelayService")) + walk(crd_schema("KVRelayPool"))
    assert len(rules) >= 7
    for node, rule in rules:
        # A map's rules use macros (self.all(k, ...)), no field names.
        for field in re.findall(r"(?:self|oldSelf)\.(\w+)\b(?!\()", rule):
            assert field in node["properties"], (field, rule)


def test_the_upgrade_hook_applies_every_crd_server_side() -> None:
    """Defect 11: `python -m kvrelay_operator.crds --apply` (the chart's pre-upgrade Job)
    server-side applies the generator's CRDs, the same ones crds/ holds."""
    from kvrelay_operator.crds import apply_all
    from tests.operator.fake_api import fake_api

    with fake_api() as (fake, kube):
        names = apply_all(kube)
    assert sorted(names) == sorted(crd["metadata"]["name"] for crd in crds().values())
    applied = fake.applied()
    assert [r.path.rsplit("/", 1)[1] for r in applied] == names
    for request in applied:
        assert request.path.startswith("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/")
        assert request.query == {"fieldManager": ["kvrelay-operator"], "force": ["true"]}
        assert request.body["kind"] == "CustomResourceDefinition"


def test_the_crd_cli_refuses_unknown_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay_operator.crds import main

    assert main([]) == 2 and main(["--aply"]) == 2
    assert "--apply" in capsys.readouterr().err


def test_crds_carry_the_production_fields() -> None:
    """Defect 7, 10, 12: the fields a production pool needs exist in the schema (a field the
    CRD lacks is pruned by the API server, silently)."""
    spec = crd_schema("KVRelayService")["properties"]["spec"]["properties"]
    for group in (
        spec["prefill"],
        spec["decode"],
        spec["router"],
        spec["ray"]["properties"]["head"],
    ):
        fields = group["properties"]
        for name in (
            "imagePullSecrets",
            "affinity",
            "topologySpreadConstraints",
            "tolerations",
            "priorityClassName",
            "runtimeClassName",
            "resources",
        ):
            assert name in fields, name
    assert "imagePullSecrets" in spec
    kv = spec["kvTransfer"]["properties"]
    assert set(kv) >= {"backend", "secretName", "ucx", "rdma", "hostNetwork"}
    assert set(kv["ucx"]["properties"]) == {"tls", "netDevices", "env"}
    assert "image" in spec["model"]["properties"]
    assert "image" in spec["model"]["properties"]["source"]["enum"]
