"""The Helm chart, rendered by Helm's own engine (helm-python-sdk): lint, schema, and every
object strictly valid for Kubernetes 1.29-1.33."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.schemas import CHART, KUBE_VERSIONS, validate_object

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: Obj | None = None) -> list[Obj]:
    manifests = chart.render(values=values, name="kv", namespace="kvrelay-system", is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


VALUES: dict[str, Obj] = {
    "default": {},
    "namespaced-with-monitoring": {
        "operator": {"watchNamespaces": ["team-a", "team-b"], "plannerSeconds": 30},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "dashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "kvrelay"}},
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "example-and-placement": {
        "image": {"repository": "my.registry/kvrelay", "tag": "1.2.3", "pullPolicy": "Always"},
        "example": {
            "enabled": True,
            "name": "chat",
            "spec": {
                "prefill": {"replicas": 2, "autoscaling": {"enabled": True, "target": "300ms"}},
                "decode": {"autoscaling": {"enabled": True, "metric": "kvUsage", "target": "0.7"}},
                "router": {"serviceType": "LoadBalancer"},
                "monitoring": {"serviceMonitor": {"enabled": True}},
            },
        },
        "operator": {
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
            "podAnnotations": {"a": "b"},
        },
    },
    "minimal": {
        "dashboards": {"enabled": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing"},
        "fullnameOverride": "relay",
    },
}


@pytest.mark.parametrize("case", sorted(VALUES))
def test_chart_lints_clean(case: str) -> None:
    report = helm.lint(CHART, VALUES[case], strict=True, kube_version="v1.29.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", sorted(VALUES))
def test_every_rendered_object_is_valid_for_each_kubernetes_version(
    chart: helm.Chart, case: str
) -> None:
    objects = render(chart, VALUES[case])
    assert objects
    for obj in objects:
        for version in KUBE_VERSIONS:
            validate_object(obj, version)
        labels = obj["metadata"]["labels"]
        for key in ("name", "instance", "version", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, (obj["kind"], key)


def _kinds(objects: list[Obj]) -> dict[str, list[Obj]]:
    out: dict[str, list[Obj]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


def test_default_install(chart: helm.Chart) -> None:
    kinds = _kinds(render(chart))
    assert sorted(kinds) == [
        "ClusterKopfPeering",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Deployment",
        "Job",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ]
    (deployment,) = kinds["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The slim operator image (test_operator_image.py); services keep the chart's image.
    assert container["image"] == "kvrelay-operator:0.1.0"
    command = container["command"]
    # The operator's own entry point (no torch), peered under the peering object's name.
    (peering,) = kinds["ClusterKopfPeering"]
    assert command[:7] == [
        "python",
        "-m",
        "kvrelay_operator",
        "--log-level",
        "INFO",
        "--peering",
        peering["metadata"]["name"],
    ]
    assert "--all-namespaces" in command
    assert "--standalone" not in command
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "probe"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Two replicas, one active (kopf peering), spread over nodes; each names itself POD_ID.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert pod["affinity"]["podAntiAffinity"]
    pod_id = next(e for e in container["env"] if e["name"] == "POD_ID")
    assert pod_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "KVRelayService" not in kinds  # the example is opt-in


def _is_hook(obj: Obj) -> bool:
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def _rules(objects: list[Obj]) -> list[Obj]:
    """The operator's rules (the CRD upgrade hook's account has its own, checked apart)."""
    return [
        r
        for o in objects
        if o["kind"] in ("Role", "ClusterRole") and not _is_hook(o)
        for r in o["rules"]
    ]


def _granted(rules: list[Obj]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_is_least_privilege(chart: helm.Chart) -> None:
    granted = _granted(_rules(render(chart)))
    assert not any("*" in item for item in granted)
    assert not any(res == "configmaps" for _, res, _ in granted)
    # Secrets: read one by name (a router's API key), create a KV secret; never list them.
    assert {v for _, res, v in granted if res == "secrets"} == {"get", "create"}
    # Children are garbage-collected through owner references, never deleted by us, except
    # a ServiceMonitor turned off and the RayCluster of a retired revision.
    deletes = {(g, r) for g, r, v in granted if v == "delete"}
    assert deletes == {("monitoring.coreos.com", "servicemonitors"), ("ray.io", "rayclusters")}
    assert ("kvrelay.io", "kvrelaypools/scale", "patch") in granted
    assert ("ray.io", "rayclusters", "patch") in granted
    assert ("", "pods", "list") in granted and ("", "pods", "create") not in granted
    # Peering of the replicas.
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in granted


def test_owner_references_may_block_deletion(chart: helm.Chart) -> None:
    """Defect 9: children set blockOwnerDeletion, which OwnerReferencesPermissionEnforcement
    allows only to whoever may update the owner's finalizers."""
    from kvrelay_operator.desired import owner_reference
    from tests.operator.services import service

    assert owner_reference(service({}))["blockOwnerDeletion"] is True
    for values in ({}, VALUES["namespaced-with-monitoring"]):
        granted = _granted(_rules(render(chart, values)))
        assert ("kvrelay.io", "kvrelayservices/finalizers", "update") in granted


def test_secrets_rights_can_be_turned_off(chart: helm.Chart) -> None:
    granted = _granted(_rules(render(chart, {"rbac": {"secrets": False}})))
    assert not any(res == "secrets" for _, res, _ in granted)


def test_crds_are_upgraded_by_a_pre_upgrade_hook(chart: helm.Chart) -> None:
    """Defect 11: Helm never upgrades crds/; a hook Job applies the new image's CRDs with an
    account that may only read and patch those CRDs."""
    objects = render(chart)
    hooks = [o for o in objects if _is_hook(o)]
    assert sorted(o["kind"] for o in hooks) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Job",
        "ServiceAccount",
    ]
    for hook in hooks:
        assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    (job,) = [o for o in hooks if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "kvrelay_operator.crds", "--apply"]
    assert container["image"] == "kvrelay-operator:0.1.0"  # the slim operator image
    (role,) = [o for o in hooks if o["kind"] == "ClusterRole"]
    (rule,) = role["rules"]
    assert rule["verbs"] == ["get", "patch"]
    assert sorted(rule["resourceNames"]) == sorted(
        crd["metadata"]["name"] for crd in (yaml.safe_load(c["data"]) for c in chart.crds)
    )
    without = render(chart, {"crds": {"upgrade": False}})
    assert not any(_is_hook(o) for o in without)


def test_watch_namespaces_get_roles_not_a_cluster_role(chart: helm.Chart) -> None:
    objects = render(chart, VALUES["namespaced-with-monitoring"])
    kinds = _kinds(objects)
    assert sorted(r["metadata"]["namespace"] for r in kinds["Role"]) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in kinds["RoleBinding"]) == ["team-a", "team-b"]
    # Only kopf's read-only discovery rights stay cluster-wide.
    (cluster_role,) = [r for r in kinds["ClusterRole"] if not _is_hook(r)]
    assert {v for r in cluster_role["rules"] for v in r["verbs"]} == {"list", "watch"}
    command = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--all-namespaces" not in command
    assert command.count("--namespace") == 2
    (monitor,) = kinds["ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    for cm in kinds["ConfigMap"]:
        assert cm["metadata"]["namespace"] == "monitoring"


def test_dashboards_are_configmaps_for_the_grafana_sidecar(chart: helm.Chart) -> None:
    configmaps = _kinds(render(chart))["ConfigMap"]
    assert len(configmaps) == 2
    for cm in configmaps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        dashboard = json.loads(text)
        assert name.endswith(".json") and dashboard["uid"] in name


def test_example_service_validates_against_its_crd(chart: helm.Chart) -> None:
    kinds = _kinds(render(chart, VALUES["example-and-placement"]))
    (example,) = kinds["KVRelayService"]
    assert example["metadata"]["name"] == "chat"
    assert example["spec"]["prefill"]["replicas"] == 2
    # The services' image (the operator runs its own: test_operator_image.py).
    command = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--image") + 1] == "my.registry/kvrelay:1.2.3"


def test_minimal_install_uses_the_existing_service_account(chart: helm.Chart) -> None:
    kinds = _kinds(render(chart, VALUES["minimal"]))
    assert sorted(kinds) == ["ClusterKopfPeering", "Deployment", "PodDisruptionBudget", "Service"]
    (deployment,) = kinds["Deployment"]
    assert deployment["metadata"]["name"] == "relay-operator"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_notes_tell_how_to_use_it(chart: helm.Chart) -> None:
    notes = chart.render(values={}, name="kv", namespace="ns", is_install=True)
    text = next(v for k, v in notes.items() if k.endswith("NOTES.txt"))
    assert "kubectl get kvrelayservices" in text
    assert "kubectl scale kvrelaypool" in text
    assert "every namespace" in text


def test_chart_ships_its_crds_and_kopfs(chart: helm.Chart) -> None:
    names = sorted(crd["name"] for crd in chart.crds)
    assert names == [
        "crds/clusterkopfpeerings.yaml",
        "crds/kopfpeerings.yaml",
        "crds/kvrelaypools.yaml",
        "crds/kvrelayservices.yaml",
    ]


def test_namespaced_operators_peer_in_each_namespace(chart: helm.Chart) -> None:
    kinds = _kinds(render(chart, VALUES["namespaced-with-monitoring"]))
    assert "ClusterKopfPeering" not in kinds
    assert sorted(p["metadata"]["namespace"] for p in kinds["KopfPeering"]) == ["team-a", "team-b"]
    for role in kinds["Role"]:
        assert any("kopfpeerings" in r["resources"] for r in role["rules"])


BAD_VALUES = [
    ("pull policy enum", {"image": {"repository": "x", "pullPolicy": "Sometimes"}}),
    ("empty repository", {"image": {"repository": "", "pullPolicy": "Always"}}),
    ("port wrong type", {"operator": {"metricsPort": "9090"}}),
    ("port out of range", {"operator": {"probePort": 70000}}),
    ("interval too short", {"operator": {"plannerSeconds": 1}}),
    ("bad namespace name", {"operator": {"watchNamespaces": ["Team_A"]}}),
    ("unknown key", {"operatr": {}}),
    ("unknown nested key", {"operator": {"replica": 2}}),
    ("no operator at all", {"operator": {"replicas": 0}}),
    ("crds flag type", {"crds": {"upgrade": "yes"}}),
    ("log level enum", {"operator": {"logLevel": "LOUD"}}),
    ("monitor interval", {"serviceMonitor": {"enabled": True, "interval": "soon"}}),
    ("example spec type", {"example": {"enabled": True, "name": "x", "spec": "big"}}),
    ("boolean wrong type", {"dashboards": {"enabled": "yes"}}),
]


@pytest.mark.parametrize("values", [b[1] for b in BAD_VALUES], ids=[b[0] for b in BAD_VALUES])
def test_bad_values_are_rejected_by_the_schema(chart: helm.Chart, values: Obj) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values(values))
    with pytest.raises(helm.HelmError):
        chart.render(values=values, name="kv", namespace="ns", is_install=True)
