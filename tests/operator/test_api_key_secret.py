"""Every router gets an API key (api_key.py), through whole reconciles against the fake API
server: a service without `router.apiKeySecret` gets `<name>-api-key` (random, owned, made
once and never rewritten), its routers read KVRELAY_API_KEY from it and the operator's own
drain calls send it; a service with its own Secret gets that one and none is generated;
without Secret rights the routers still ask for it (closed), and the chart grants the rights."""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest

from kvrelay_operator.api_key import api_key_ref, desired_api_key_secret, new_api_key
from kvrelay_operator.kube import Kube
from kvrelay_operator.reconcile import reconcile
from kvrelay_operator.router_deployment import router_command
from tests.deploy.schemas import CHART
from tests.deploy.test_chart import _granted, _rules, render
from tests.operator.fake_api import FakeApi
from tests.operator.router_stub import RouterStub
from tests.operator.services import IMAGE, service, service_body
from tests.operator.test_lifecycle import _start

SECRETS = "/api/v1/namespaces/llm/secrets"
SVC = "/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/demo"
DEPLOYMENT = "/apis/apps/v1/namespaces/llm/deployments/demo-router"
GENERATED = f"{SECRETS}/demo-api-key"
T0 = 1_800_000_000.0


def _reconcile(fake: FakeApi, kube: Kube, now: float = T0, url: str = "http://127.0.0.1:9") -> None:
    reconcile(kube, fake.objects[SVC], IMAGE, now, router_url=lambda _: url)


def _key_of(secret: dict[str, Any], key: str = "api-key") -> str:
    return base64.b64decode(secret["data"][key]).decode()


def _router_container(fake: FakeApi) -> dict[str, Any]:
    """The router container as last applied."""
    applied = [r.body for r in fake.applied() if r.path == DEPLOYMENT]
    (container,) = applied[-1]["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _key_env(container: dict[str, Any]) -> dict[str, Any]:
    (env,) = [e for e in container["env"] if e["name"] == "KVRELAY_API_KEY"]
    return dict(env["valueFrom"]["secretKeyRef"])


def _creates(fake: FakeApi, name: str) -> int:
    made = [r for r in fake.requests if r.method == "POST" and r.path == SECRETS]
    return [r.body["metadata"]["name"] for r in made].count(name)


def test_without_a_secret_the_operator_makes_one_and_the_routers_read_it(
    api: tuple[FakeApi, Kube],
) -> None:
    fake, kube = api
    fake.put(SVC, service_body({}))
    _reconcile(fake, kube)
    secret = fake.objects[GENERATED]
    key = _key_of(secret)
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", key)  # 256 random bits, URL-safe base64
    assert secret["type"] == "Opaque"
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("KVRelayService", "demo", True)
    container = _router_container(fake)
    assert _key_env(container) == {"name": "demo-api-key", "key": "api-key"}
    command = container["command"]
    assert command[command.index("--api-key-env") + 1] == "KVRELAY_API_KEY"
    assert "--allow-unauthenticated" not in command  # the CLI would start it open


def test_the_generated_secret_survives_reconciles_unchanged(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.put(SVC, service_body({}))
    _reconcile(fake, kube)
    first = dict(fake.objects[GENERATED])
    for step in range(1, 4):
        _reconcile(fake, kube, T0 + 10 * step)
    assert fake.objects[GENERATED] == first
    assert _creates(fake, "demo-api-key") == 1
    # Never applied or patched either: clients hold the key.
    assert not [r for r in fake.requests if r.path == GENERATED and r.method != "GET"]


def test_an_existing_secret_of_that_name_is_kept(api: tuple[FakeApi, Kube]) -> None:
    """A key someone set (or rotated) by hand in <name>-api-key is the one the routers get."""
    fake, kube = api
    mine = {"data": {"api-key": base64.b64encode(b"chosen-by-hand").decode()}}
    fake.put(GENERATED, mine)
    fake.put(SVC, service_body({}))
    _reconcile(fake, kube)
    assert _key_of(fake.objects[GENERATED]) == "chosen-by-hand"
    assert _creates(fake, "demo-api-key") == 0


def test_the_users_secret_is_used_and_none_is_generated(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    fake.put(SVC, service_body({"router": {"apiKeySecret": {"name": "team", "key": "token"}}}))
    _reconcile(fake, kube)
    assert _key_env(_router_container(fake)) == {"name": "team", "key": "token"}
    assert GENERATED not in fake.objects and _creates(fake, "demo-api-key") == 0
    assert not [r for r in fake.requests if r.path == GENERATED]  # not even looked up
    assert api_key_ref(service({"router": {"apiKeySecret": {"name": "team"}}})) == (
        "team",
        "api-key",
    )


def test_each_service_gets_its_own_key(api: tuple[FakeApi, Kube]) -> None:
    fake, kube = api
    for name in ("demo", "other"):
        path = f"/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/{name}"
        fake.put(path, service_body({}, name=name))
        reconcile(kube, fake.objects[path], IMAGE, T0, router_url=lambda _: "http://127.0.0.1:9")
    keys = {_key_of(fake.objects[f"{SECRETS}/{n}-api-key"]) for n in ("demo", "other")}
    assert len(keys) == 2
    assert len({new_api_key() for _ in range(100)}) == 100


def test_without_secret_rights_the_routers_still_ask_for_the_key(
    api: tuple[FakeApi, Kube], caplog: pytest.LogCaptureFixture
) -> None:
    """Closed, never open: the Deployment names the Secret, so its pods wait for it."""
    fake, kube = api
    fake.failures[("GET", SECRETS)] = 403
    fake.put(SVC, service_body({"kvTransfer": {"secretName": "mine"}}))
    with caplog.at_level(logging.WARNING, logger="kvrelay_operator.api_key"):
        _reconcile(fake, kube)
    (record,) = [r for r in caplog.records if r.name == "kvrelay_operator.api_key"]
    message = record.getMessage()
    assert all(part in message for part in ("demo-api-key", "apiKeySecret", "rbac.secrets"))
    assert GENERATED not in fake.objects
    assert _key_env(_router_container(fake)) == {"name": "demo-api-key", "key": "api-key"}


def test_the_operators_drain_sends_the_generated_key(
    api: tuple[FakeApi, Kube], router: RouterStub
) -> None:
    fake, kube = api
    _start(fake, kube, {"decode": {"replicas": 3}}, router)
    router.api_key = _key_of(fake.objects[GENERATED])
    kube.scale("kvrelay.io/v1alpha1", "KVRelayPool", "llm", "demo-decode", 2)
    _reconcile(fake, kube, T0 + 10, router.url)
    assert router.drains() == [["d-1"]]  # the stub refuses a request without the key
    assert {auth for *_, auth in router.requests} == {f"Bearer {router.api_key}"}


def test_the_secret_body_and_the_command_for_every_spec() -> None:
    spec = service({"router": {"replicas": 3}})
    body = desired_api_key_secret(spec, "k")
    assert body["metadata"]["name"] == "demo-api-key" and _key_of(body) == "k"
    assert body["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert router_command(spec, "r" * 12).count("--api-key-env") == 1


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_the_chart_lets_the_operator_read_and_create_the_secret(chart: helm.Chart) -> None:
    granted = _granted(_rules(render(chart, {})))
    assert {("", "secrets", "get"), ("", "secrets", "create")} <= granted
    closed = _granted(_rules(render(chart, {"rbac": {"secrets": False}})))
    assert ("", "secrets", "create") not in closed  # then the warning above says what to do


def test_the_charts_notes_say_where_the_key_is(chart: helm.Chart) -> None:
    """The NOTES' curl works against a router that requires the key."""
    notes = chart.render(values={}, name="kv", namespace="ns", is_install=True)
    text = next(v for k, v in notes.items() if k.endswith("NOTES.txt"))
    assert "kubectl get secret demo-api-key -o jsonpath='{.data.api-key}'" in text
    assert 'curl http://127.0.0.1:8000/v1/models -H "Authorization: Bearer $KEY"' in text
