"""Parsing a KVRelayService: targets, errors, and defaults that agree with the CRD's."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay_operator.errors import PermanentError, RetryableError, SpecError, classify_api_error
from kvrelay_operator.spec import parse_service, parse_target
from tests.operator.services import IMAGE, service_body


@pytest.mark.parametrize(
    ("metric", "text", "value"),
    [("ttft", "500ms", 0.5), ("ttft", "1.5s", 1.5), ("itl", "40ms", 0.04), ("kvUsage", "0.8", 0.8)],
)
def test_parse_target(metric: str, text: str, value: float) -> None:
    assert parse_target(metric, text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("metric", "text"),
    [("ttft", "0.5"), ("itl", "fast"), ("ttft", "0ms"), ("kvUsage", "80ms"), ("kvUsage", "1.5")],
)
def test_bad_targets(metric: str, text: str) -> None:
    with pytest.raises(SpecError):
        parse_target(metric, text)


def test_parser_defaults_equal_the_crd_defaults() -> None:
    """A raw empty spec parsed by the operator equals the API server's defaulted one."""
    raw = {
        "apiVersion": "kvrelay.io/v1alpha1",
        "kind": "KVRelayService",
        "metadata": {"name": "demo", "namespace": "llm", "uid": "uid-1234", "generation": 1},
        "spec": {},
    }
    assert parse_service(raw, IMAGE) == parse_service(service_body({}), IMAGE)
    with_auto = {"prefill": {"autoscaling": {"enabled": True}}, "decode": {"autoscaling": {}}}
    raw["spec"] = with_auto
    assert parse_service(raw, IMAGE) == parse_service(service_body(with_auto), IMAGE)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": {"source": "pvc"}}, "claimName"),
        ({"model": {"source": "folder", "folder": {"path": "rel/path"}}}, "absolute"),
        ({"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "minReplicas"),
        ({"prefill": {"autoscaling": {"metric": "kvUsage", "target": "0.5"}}}, "metric"),
        ({"decode": {"autoscaling": {"metric": "kvUsage", "target": "80ms"}}}, "ratio"),
        ({"prefill": {"replicas": -1}}, ">= 0"),
    ],
)
def test_specs_the_crd_would_reject_are_spec_errors(spec: dict[str, Any], message: str) -> None:
    """The operator does not trust that admission ran: a bad spec is a SpecError."""
    body = {"metadata": {"name": "demo", "namespace": "llm"}, "spec": spec}
    with pytest.raises(SpecError, match=message):
        parse_service(body, IMAGE)


def test_no_image_anywhere_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="image"):
        parse_service(service_body({}), default_image="")


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (None, RetryableError),
        (404, RetryableError),
        (409, RetryableError),
        (429, RetryableError),
        (503, RetryableError),
        (400, PermanentError),
        (403, PermanentError),
        (422, PermanentError),
    ],
)
def test_api_errors_are_classified(status: int | None, kind: type) -> None:
    assert isinstance(classify_api_error(status, "x"), kind)


@pytest.mark.parametrize("name", ["llama3.1", "8b-chat", "Demo", "chat-", "a_b", "x" * 41])
def test_names_that_cannot_name_the_children_are_refused(name: str) -> None:
    """Defect 6: `<name>-router` is a Service and KubeRay names pods after the cluster: both
    need DNS-1035 labels. The parser and the CRD refuse the same names."""
    import re

    from kvrelay_operator.crds import service_crd

    body = service_body({})
    body["metadata"]["name"] = name
    with pytest.raises(SpecError, match="DNS-1035"):
        parse_service(body, IMAGE)
    schema = service_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [v["rule"] for v in schema["x-kubernetes-validations"]]
    (pattern,) = [re.search(r"matches\('(.*)'\)", r).group(1) for r in rules if "matches" in r]
    too_long = any("size(self.metadata.name) <= 40" in r for r in rules)
    assert not re.match(pattern, name) or (len(name) > 40 and too_long)


@pytest.mark.parametrize("name", ["llama3-1", "demo", "a", "chat-8b"])
def test_dns_1035_names_pass(name: str) -> None:
    body = service_body({})
    body["metadata"]["name"] = name
    assert parse_service(body, IMAGE).name == name
