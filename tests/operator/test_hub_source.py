"""`model.source: hub` (issue 40): a Hugging Face id and revision, checked by the CRD and the
operator as kvrelay checks `--model`, pulled by each pod's init container into the cache
volume (with the token Secret, if named, seen by the pull alone), served offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrelay.cli import build_parser
from kvrelay.common.model_ref import HubId, ModelNotFoundError, parse_model_ref
from kvrelay_operator.desired import desired_objects
from kvrelay_operator.errors import SpecError
from kvrelay_operator.revision import revision_hash
from kvrelay_operator.spec import ModelSource, parse_service
from tests.deploy.schemas import validate_everywhere
from tests.operator.services import IMAGE, service

NO_POOLS: dict[str, int | None] = {"prefill": None, "decode": None}
HUB = {"source": "hub", "hub": {"id": "Qwen/Qwen3-0.6B", "revision": "c1899de2"}}


def _pods(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """component -> pod spec, for the router, the head and each worker group (validated)."""
    objects = desired_objects(service(spec), NO_POOLS)
    for obj in objects:
        validate_everywhere(obj)
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    router = next(o for o in objects if o["kind"] == "Deployment")
    out = {g["groupName"]: g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]}
    out["head"] = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    out["router"] = router["spec"]["template"]["spec"]
    return out


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_a_hub_source_parses_with_its_defaults() -> None:
    model = service({"model": {"source": "hub", "hub": {"id": "Org/Name"}}}).model
    assert (model.source, model.hub_id, model.hub_revision) == ("hub", "Org/Name", "main")
    assert (model.hub_token_secret, model.hub_token_key) == ("", "token")
    assert not model.mounted


@pytest.mark.parametrize(
    ("hub", "message"),
    [
        ({}, "model.hub.id '' must be a Hugging Face id"),
        ({"id": "no-org"}, "must be a Hugging Face id ORG/NAME"),
        ({"id": "a/b/c"}, "ORG/NAME"),
        ({"id": "org/na--me"}, "ORG/NAME"),
        ({"id": "or..g/name"}, "ORG/NAME"),
        ({"id": "org/name", "revision": "v1 beta"}, "model.hub.revision 'v1 beta'"),
        ({"id": "org/name", "revision": "a@b"}, "no '@'"),
        ({"id": "org/name", "revision": ""}, "model.hub.revision ''"),
    ],
)
def test_the_operator_refuses_a_bad_id_or_revision(hub: dict[str, Any], message: str) -> None:
    """Without admission's checks too (a SpecError, as for the other sources)."""
    body = {"metadata": {"name": "demo", "namespace": "llm"}, "spec": {"model": {
        "source": "hub", "hub": hub}}}  # fmt: skip
    with pytest.raises(SpecError, match=message):
        parse_service(body, IMAGE)


@pytest.mark.parametrize(
    "hub",
    [{}, {"id": "no-org"}, {"id": "a/b/c"}, {"id": "-org/name"}, {"id": "org/name."},
     {"id": "org/name", "revision": "a@b"}, {"id": "org/name", "revision": "v 1"},
     {"id": "org/name", "tokenSecret": {}}],
)  # fmt: skip
def test_the_crd_refuses_them_at_admission(hub: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="hub"):
        service({"model": {"source": "hub", "hub": hub}})


IDS = ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "a/b", "org_x/m.v2", "no-org", "a/b/c",
       "org/-x", "org/x-", "org/x.", ".org/x", "org/na--me", "or..g/x", "org/x y", "org/é",
       "o" * 96 + "/x", "o" * 97 + "/x"]  # fmt: skip


@pytest.mark.parametrize("hub_id", IDS)
def test_the_operator_and_kvrelay_agree_on_what_an_id_is(
    hub_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    try:
        kvrelay_ok = parse_model_ref(hub_id) == HubId(hub_id)
    except ModelNotFoundError:
        kvrelay_ok = False
    try:
        ModelSource.parse({"source": "hub", "hub": {"id": hub_id}})
        operator_ok = True
    except SpecError:
        operator_ok = False
    assert operator_ok == kvrelay_ok


def test_every_kvrelay_pod_pulls_the_snapshot_then_serves_it_offline() -> None:
    spec = {"model": {**HUB, "hub": {**HUB["hub"], "tokenSecret": {"name": "hf"}}}}
    pods = _pods(spec)
    for component in ("router", "prefill", "decode"):
        pod = pods[component]
        (init,) = pod["initContainers"]
        assert init["command"] == ["kvrelay", "model", "pull", "Qwen/Qwen3-0.6B@c1899de2"]
        assert {"name": "cache", "mountPath": "/var/cache/kvrelay"} in init["volumeMounts"]
        pull_env = _env(init)
        assert pull_env["HF_HUB_CACHE"] == "/var/cache/kvrelay/huggingface/hub"
        assert "HF_HUB_OFFLINE" not in pull_env  # the pull is the one step with the network
        assert pull_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        serve_env = _env(pod["containers"][0])
        assert serve_env["HF_HUB_OFFLINE"] == "1"
        assert serve_env["HF_HUB_CACHE"] == pull_env["HF_HUB_CACHE"]
        assert "HF_TOKEN" not in serve_env  # the token stays with the pull
    router = pods["router"]["containers"][0]["command"]
    assert router[router.index("--model") + 1] == "Qwen/Qwen3-0.6B@c1899de2"


def test_the_pull_fetches_the_gguf_a_quantization_reads() -> None:
    pods = _pods({"model": HUB, "engineArgs": ["--quantization=q4_1", "--dtype=bfloat16"]})
    assert pods["decode"]["initContainers"][0]["command"][-2:] == [
        "Qwen/Qwen3-0.6B@c1899de2",
        "--quantization=q4_1",
    ]
    pods = _pods({"model": HUB, "engineArgs": ["--quantization=q4_1", "--quantization=q8_0"]})
    assert pods["decode"]["initContainers"][0]["command"][-1] == "--quantization=q8_0"
    assert "HF_TOKEN" not in _env(pods["decode"]["initContainers"][0])  # no Secret named


def test_the_pods_commands_are_ones_kvrelay_accepts() -> None:
    """The init container's and the router's command lines parse with kvrelay's own CLI."""
    pods = _pods({"model": HUB, "engineArgs": ["--quantization=q8_0"]})
    pull = build_parser().parse_args(pods["decode"]["initContainers"][0]["command"][1:])
    assert (pull.model, pull.quantization) == ("Qwen/Qwen3-0.6B@c1899de2", "q8_0")
    router = pods["router"]["containers"][0]["command"]
    ns = build_parser().parse_args(router[router.index("router") :])
    assert ns.model == "Qwen/Qwen3-0.6B@c1899de2"


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"source": "hub", "hub": {"id": "Qwen/Qwen3-1.7B", "revision": "c1899de2"}}},
        {"model": {"source": "hub", "hub": {"id": "Qwen/Qwen3-0.6B", "revision": "main"}}},
    ],
)
def test_another_id_or_revision_is_another_worker_revision(change: dict[str, Any]) -> None:
    assert revision_hash(service(change)) != revision_hash(service({"model": HUB}))
