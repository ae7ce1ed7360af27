"""The default model cached once per service (issue 43): with `model.cache.shared` one Job
fills a claim that every router and worker mounts read-only and waits for, instead of each
pod downloading and converting the model. The objects are validated against Kubernetes'
schemas, applied through a reconcile against the fake API server, granted by the chart's
RBAC, and the wait and fill scripts are run for real."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest

from kvrelay_operator import model_cache
from kvrelay_operator.desired import desired_objects
from kvrelay_operator.errors import SpecError
from kvrelay_operator.kube import PLURALS
from kvrelay_operator.reconcile import reconcile
from tests.deploy.schemas import CHART, validate_everywhere
from tests.deploy.test_chart import _granted, _rules, render
from tests.operator.fake_api import fake_api
from tests.operator.services import IMAGE, service, service_body

Obj = dict[str, Any]
NO_POOLS: dict[str, int | None] = {"prefill": None, "decode": None}
SHARED = {"model": {"source": "default", "cache": {"shared": True}}}
MODELS = "/var/cache/kvrelay/models"
MARKER = f"{MODELS}/.kvrelay-default-ready"


def _objects(spec: Obj, **kwargs: Any) -> dict[str, list[Obj]]:
    out: dict[str, list[Obj]] = {}
    for obj in desired_objects(service(spec, **kwargs), NO_POOLS):
        validate_everywhere(obj)
        out.setdefault(obj["kind"], []).append(obj)
    return out


def _pods(objects: dict[str, list[Obj]]) -> dict[str, Obj]:
    """component -> pod spec of every kvrelay pod: router, head, prefill, decode."""
    (cluster,) = objects["RayCluster"]
    (router,) = objects["Deployment"]
    pods = {g["groupName"]: g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]}
    pods["head"] = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    pods["router"] = router["spec"]["template"]["spec"]
    return pods


def test_without_the_cache_each_pod_converts_the_model_itself() -> None:
    objects = _objects({})
    assert "Job" not in objects and "PersistentVolumeClaim" not in objects
    for name in ("router", "prefill", "decode"):
        (init,) = _pods(objects)[name]["initContainers"]
        assert init["command"] == ["kvrelay", "model", "pull-default"]


def test_one_job_fills_one_claim_for_the_whole_service() -> None:
    spec = {"model": {"cache": {"shared": True, "size": "8Gi", "storageClassName": "nfs"}}}
    objects = _objects(spec)
    (claim,) = objects["PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "demo-model-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert claim["spec"]["storageClassName"] == "nfs"
    (job,) = objects["Job"]
    assert job["metadata"]["name"].startswith("demo-model-cache-")
    assert job["metadata"]["ownerReferences"][0]["kind"] == "KVRelayService"
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert container["command"][-1] == f"kvrelay model pull-default && touch {MARKER}"
    assert container["volumeMounts"] == [
        {"name": "model-cache", "mountPath": MODELS, "readOnly": False}
    ]
    assert pod["volumes"] == [
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "demo-model-cache"}}
    ]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_router_and_workers_mount_it_read_only_and_wait_instead_of_converting() -> None:
    pods = _pods(_objects(SHARED))
    for name in ("router", "prefill", "decode", "head"):
        pod = pods[name]
        assert {
            "name": "model-cache",
            "persistentVolumeClaim": {"claimName": "demo-model-cache"},
        } in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "model-cache", "mountPath": MODELS, "readOnly": True} in mounts
        # The rest of the cache stays the pod's own (writable) volume.
        assert {"name": "cache", "mountPath": "/var/cache/kvrelay"} in mounts
    for name in ("router", "prefill", "decode"):
        (init,) = pods[name]["initContainers"]
        assert init["name"] == "wait-model-cache"
        assert MARKER in init["command"][-1] and "pull-default" not in init["command"][-1]
        assert init["volumeMounts"] == [
            {"name": "model-cache", "mountPath": MODELS, "readOnly": True}
        ]


def test_a_named_claim_is_used_not_created() -> None:
    """An air-gapped cluster pre-fills its own claim; the Job's pull is then a no-op."""
    objects = _objects({"model": {"cache": {"shared": True, "claimName": "prefilled"}}})
    assert "PersistentVolumeClaim" not in objects
    (job,) = objects["Job"]
    claim = job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
    assert claim == {"claimName": "prefilled"}
    decode = _pods(objects)["decode"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "prefilled"}} in (
        decode["volumes"]
    )


def test_a_new_image_gets_a_new_job_the_same_image_keeps_it() -> None:
    """A Job's pod template is immutable: applying a changed one would be refused."""
    name = model_cache.job_name
    assert name(service(SHARED)) == name(service(SHARED, generation=5))
    assert name(service(SHARED)) != name(service({**SHARED, "image": "kvrelay:2"}))
    assert len(name(service(SHARED, name="a" * 40))) <= 63


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": "hub", "hub": {"id": "Org/M"}, "cache": {"shared": True}}, "source default"),
        ({"cache": {"claimName": "c"}}, "shared: true"),
    ],
)
def test_a_cache_that_cannot_apply_is_refused(spec: Obj, message: str) -> None:
    from kvrelay_operator.spec import parse_service

    body = {"metadata": {"name": "demo"}, "spec": {"model": spec}}
    with pytest.raises(SpecError, match=message):
        parse_service(body, IMAGE)


def test_the_crd_refuses_a_bad_access_mode_and_size() -> None:
    for cache in ({"shared": True, "accessMode": "ReadOnlyMany"}, {"size": "big"}):
        with pytest.raises(jsonschema.ValidationError):
            service_body({"model": {"cache": cache}})


def test_a_reconcile_applies_the_claim_and_the_job() -> None:
    with fake_api() as (fake, kube):
        svc = "/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/demo"
        fake.put(svc, service_body(SHARED))
        reconcile(kube, fake.objects[svc], IMAGE, 1_800_000_000.0, lambda _: "http://127.0.0.1:9")
        job = model_cache.job_name(service(SHARED))
        paths = [r.path for r in fake.applied()]
    claim_path = "/api/v1/namespaces/llm/persistentvolumeclaims/demo-model-cache"
    job_path = f"/apis/batch/v1/namespaces/llm/jobs/{job}"
    assert claim_path in paths and job_path in paths
    # Before the pods that mount the claim.
    ray = next(i for i, p in enumerate(paths) if "/rayclusters/" in p)
    assert paths.index(claim_path) < ray and paths.index(job_path) < ray


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_the_chart_lets_the_operator_make_them(chart: helm.Chart) -> None:
    granted = _granted(_rules(render(chart)))
    for kind, group in (("Job", "batch"), ("PersistentVolumeClaim", "")):
        for verb in ("get", "create", "patch"):
            assert (group, PLURALS[kind], verb) in granted, (kind, verb)
        assert (group, PLURALS[kind], "delete") not in granted


def _script(container: Obj, marker: Path) -> str:
    return str(container["command"][-1]).replace(MARKER, str(marker))


def test_the_wait_holds_the_pod_until_the_marker_appears(tmp_path: Path) -> None:
    (init,) = _pods(_objects(SHARED))["decode"]["initContainers"]
    marker = tmp_path / "ready"
    proc = subprocess.Popen(["/bin/sh", "-c", _script(init, marker)], stdout=subprocess.PIPE)
    try:
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting
        marker.touch()
        assert proc.wait(timeout=model_cache.WAIT_SECONDS + 5) == 0
    finally:
        proc.kill()
    assert b"waiting for the model cache Job demo-model-cache-" in (proc.stdout or b"").read()


@pytest.mark.parametrize(("status", "ready"), [(0, True), (3, False)])
def test_the_job_marks_the_cache_ready_only_after_a_good_pull(
    tmp_path: Path, status: int, ready: bool
) -> None:
    (job,) = _objects(SHARED)["Job"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kvrelay"  # stands for the image's kvrelay: the pull's exit status only
    fake.write_text(f"#!/bin/sh\n[ \"$*\" = 'model pull-default' ] || exit 9\nexit {status}\n")
    fake.chmod(0o755)
    marker = tmp_path / "ready"
    script = _script(job["spec"]["template"]["spec"]["containers"][0], marker)
    result = subprocess.run(
        ["/bin/sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, check=False
    )
    assert (result.returncode == 0, marker.exists()) == (ready, ready)
