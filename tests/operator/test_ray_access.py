"""Who may talk to a service's Ray cluster (issue 41): every Ray process and the router run
with Ray's token authentication and the token from the service's Secret, made once; the
NetworkPolicy selects exactly the Ray pods and lets in only the service's own pods, on every
port; a Ray without token authentication is refused; the chart lets the operator do all this."""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import helm_python as helm
import pytest

from kvrelay_operator.desired import desired_objects
from kvrelay_operator.errors import PermanentError
from kvrelay_operator.kube import PLURALS, Kube
from kvrelay_operator.names import labels
from kvrelay_operator.ray_access import (
    RAY_AUTH_MODE_ENV,
    RAY_AUTH_TOKEN_ENV,
    desired_ray_network_policy,
    require_token_auth,
)
from kvrelay_operator.reconcile import reconcile
from tests.deploy.schemas import CHART
from tests.deploy.test_chart import _granted, _rules, render
from tests.operator.fake_api import FakeApi
from tests.operator.services import IMAGE, service, service_body
from tests.operator.test_desired import NO_POOLS, SPECS

Obj = dict[str, Any]
SVC = "/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/demo"
TOKEN_SECRET = "/api/v1/namespaces/llm/secrets/demo-ray-auth"
NOW = 1_800_000_000.0
TOKEN_ENV = [
    {"name": RAY_AUTH_MODE_ENV, "value": "token"},
    {
        "name": RAY_AUTH_TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": "demo-ray-auth", "key": "auth_token"}},
    },
]


def _kind(objects: list[Obj], kind: str) -> Obj:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def _pod_templates(objects: list[Obj]) -> dict[str, Obj]:
    """Pod templates by component: the head, each worker group, the router."""
    ray = _kind(objects, "RayCluster")["spec"]
    templates = {"ray-head": ray["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in ray["workerGroupSpecs"]})
    templates["router"] = _kind(objects, "Deployment")["spec"]["template"]
    return templates


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_ray_process_and_the_router_use_the_services_token(case: str) -> None:
    templates = _pod_templates(desired_objects(service(SPECS[case]), NO_POOLS))
    assert sorted(templates) == ["decode", "prefill", "ray-head", "router"]
    for component, template in templates.items():
        for container in template["spec"]["containers"]:
            env = [e for e in container["env"] if e["name"].startswith("RAY_AUTH")]
            assert env == TOKEN_ENV, (component, container["name"])


def _matches(selector: Mapping[str, Any], pod_labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists)."""
    if any(pod_labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        value = pod_labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and value is None:
            return False
    return True


@pytest.mark.parametrize("case", sorted(SPECS))
def test_only_the_services_own_pods_reach_its_ray_pods(case: str) -> None:
    objects = desired_objects(service(SPECS[case]), NO_POOLS)
    policy = _kind(objects, "NetworkPolicy")["spec"]
    templates = {c: t["metadata"]["labels"] for c, t in _pod_templates(objects).items()}
    # Selected: the head and every worker group (every revision: no revision label). Not the
    # router: it has no Ray listener, and its clients come from anywhere.
    selected = {c for c, pod in templates.items() if _matches(policy["podSelector"], pod)}
    assert selected == {"ray-head", "prefill", "decode"}
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert "ports" not in rule  # every port: Ray's own, the KV and stream servers
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: this namespace only
    for component, pod in templates.items():
        assert _matches(peer["podSelector"], pod), component
    strangers = {
        "another service's worker": labels("other", "decode"),
        "another service's router": labels("other", "router"),
        "an unlabelled pod": {},
        "a pod claiming the instance only": {"app.kubernetes.io/instance": "demo"},
    }
    for name, pod in strangers.items():
        assert not _matches(peer["podSelector"], pod), name


def test_the_policy_is_named_and_owned_like_every_child() -> None:
    spec = service({})
    policy = desired_ray_network_policy(spec)
    assert policy["metadata"]["name"] == "demo-ray"
    (owned,) = [o for o in desired_objects(spec, NO_POOLS) if o["kind"] == "NetworkPolicy"]
    assert owned["metadata"]["ownerReferences"][0]["name"] == "demo"


@pytest.mark.parametrize("version", ["2.52.0", "2.60.0", "2.100.1", "3.0", "nightly"])
def test_ray_with_token_auth_is_accepted(version: str) -> None:
    require_token_auth(version)


@pytest.mark.parametrize("version", ["2.51.1", "2.9.3", "1.13.0", " 2.40"])
def test_ray_without_token_auth_is_refused(version: str) -> None:
    with pytest.raises(PermanentError, match=r"spec\.ray\.rayVersion .*2\.52"):
        require_token_auth(version)


def _reconcile(fake: FakeApi, kube: Kube, now: float = NOW) -> None:
    reconcile(kube, fake.objects[SVC], IMAGE, now, router_url=lambda _: "http://127.0.0.1:9")


def test_the_token_secret_is_made_once_and_owned(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.put(SVC, service_body({}))
    _reconcile(fake, kube)
    secret = fake.objects[TOKEN_SECRET]
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", token)  # 256 bits, as Ray generates its own
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "KVRelayService"
    _reconcile(fake, kube, NOW + 10)
    assert base64.b64decode(fake.objects[TOKEN_SECRET]["data"]["auth_token"]).decode() == token
    made = [r for r in fake.requests if r.method == "POST" and r.path.endswith("/secrets")]
    assert [r.body["metadata"]["name"] for r in made].count("demo-ray-auth") == 1
    assert any("networkpolicies/demo-ray" in r.path for r in fake.applied())


def test_without_secret_rights_the_reconcile_goes_on_and_says_what_is_needed(
    api: tuple[FakeApi, Kube], caplog: pytest.LogCaptureFixture
) -> None:
    fake, kube = api
    fake.failures[("GET", "/api/v1/namespaces/llm/secrets")] = 403
    fake.put(SVC, service_body({"kvTransfer": {"secretName": "mine"}}))
    with caplog.at_level(logging.WARNING, logger="kvrelay_operator.ray_access"):
        _reconcile(fake, kube)
    (record,) = [r for r in caplog.records if r.name == "kvrelay_operator.ray_access"]
    assert "demo-ray-auth" in record.getMessage() and "rbac.secrets" in record.getMessage()
    assert TOKEN_SECRET not in fake.objects
    # The pods still ask for the token: without the Secret they do not start.
    (cluster,) = [r.body for r in fake.applied() if r.body["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert [e for e in head["env"] if e["name"].startswith("RAY_AUTH")] == TOKEN_ENV


def test_a_ray_without_token_auth_fails_the_reconcile(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.put(SVC, service_body({"ray": {"rayVersion": "2.47.1"}}))
    with pytest.raises(PermanentError, match=r"2\.47\.1"):
        _reconcile(fake, kube)
    ready = fake.objects[SVC]["status"]["conditions"][0]
    assert (ready["reason"], "2.52" in ready["message"]) == ("ApplyFailed", True)
    assert not any("rayclusters" in r.path for r in fake.applied())


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.mark.parametrize("values", [{}, {"operator": {"watchNamespaces": ["team-a"]}}])
def test_the_chart_lets_the_operator_apply_every_child_it_makes(
    chart: helm.Chart, values: Obj
) -> None:
    """Every kind the operator applies (the NetworkPolicy among them) is granted to it."""
    granted = _granted(_rules(render(chart, values)))
    spec = service(SPECS["placed-autoscaled-monitored"])
    for obj in desired_objects(spec, NO_POOLS):
        group = obj["apiVersion"].rpartition("/")[0]
        for verb in ("get", "create", "patch"):
            assert (group, PLURALS[obj["kind"]], verb) in granted, (obj["kind"], verb)
    assert ("networking.k8s.io", "networkpolicies", "delete") not in granted


def test_token_auth_is_part_of_the_revision() -> None:
    """Services made before token authentication get a new revision (a new RayCluster,
    blue/green) rather than token-mode workers joining a head that has none."""
    from kvrelay_operator.revision import revision_inputs

    assert revision_inputs(service({}))["rayAuth"] == "token"
