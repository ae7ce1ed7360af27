"""Rolling upgrades through whole reconciles against the fake API server, with a toy KubeRay,
scheduler, router Deployment and clients around it (cluster_sim.py): a P/D service on a
cluster with no spare slot moves to a new image with no request failed and no worker cut
mid-stream; a revision that cannot be placed is reported past its deadline, as a condition
and an Event, and rolled back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay_operator.kube import Kube
from kvrelay_operator.reconcile import reconcile
from kvrelay_operator.revision import revision_hash
from tests.deploy.schemas import validate_custom
from tests.operator.cluster_sim import RAYS, ClusterSim
from tests.operator.fake_api import FakeApi, fake_api
from tests.operator.router_stub import router_stub
from tests.operator.services import IMAGE, cluster_of, service, service_body

SVC = "/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/demo"
EVENTS = "/api/v1/namespaces/llm/events"
T0 = 1_800_000_000.0
TICK = 5.0


def _spec(image: str, decode: dict[str, Any] | None = None, **upgrade: Any) -> dict[str, Any]:
    pool = {"replicas": 2, "drainTimeoutSeconds": 60}
    spec = {"image": image, "prefill": pool, "decode": {**pool, **(decode or {})}}
    # The sim runs one router pod per revision.
    return {**spec, "upgrade": upgrade, "router": {"replicas": 1}}


@pytest.fixture
def sim() -> Iterator[tuple[FakeApi, Kube, ClusterSim]]:
    with fake_api() as (fake, kube), router_stub() as stub:
        yield fake, kube, ClusterSim(fake, stub, slots=4)


def _reconcile(fake: FakeApi, kube: Kube, sim: ClusterSim, now: float) -> None:
    reconcile(kube, fake.objects[SVC], IMAGE, now, router_url=lambda _: sim.router.url)
    validate_custom(fake.objects[SVC])  # what the operator wrote fits the CRD's status


def _edit(fake: FakeApi, spec: dict[str, Any], generation: int) -> None:
    status = fake.objects[SVC]["status"]
    fake.put(SVC, service_body(spec, generation=generation, status=status))


def _clusters(fake: FakeApi) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in fake.objects if p.startswith(f"{RAYS}/"))


def _groups(fake: FakeApi, cluster: str) -> dict[str, int]:
    spec = fake.objects[f"{RAYS}/{cluster}"]["spec"]
    return {g["groupName"]: g["replicas"] for g in spec["workerGroupSpecs"]}


def _conditions(fake: FakeApi) -> dict[str, tuple[str, str]]:
    conditions = fake.objects[SVC]["status"]["conditions"]
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


def _run_until_serving(fake: FakeApi, kube: Kube, sim: ClusterSim, now: float) -> float:
    for _ in range(20):
        _reconcile(fake, kube, sim, now)
        sim.tick()
        now += TICK
        if _conditions(fake).get("Ready", ("",))[0] == "True":
            return now
    raise AssertionError(f"never ready: {fake.objects[SVC]['status']['conditions']}")


GPUS = {"resources": {"limits": {"nvidia.com/gpu": 2}}}


@pytest.mark.parametrize(
    ("image", "decode", "surge"),
    [
        ("kvrelay:b", None, 0),
        ("kvrelay:b", None, 1),
        ("kvrelay:b", None, 2),
        # A pod setting outside the engine: it reaches the running pods the same way.
        ("kvrelay:a", GPUS, 1),
        ("kvrelay:a", {"cpusPerWorker": 6}, 1),
    ],
)
def test_a_rolling_upgrade_fits_a_full_cluster_and_fails_no_request(
    sim: tuple[FakeApi, Kube, ClusterSim], image: str, decode: dict[str, Any] | None, surge: int
) -> None:
    fake, kube, cluster = sim
    old_spec = _spec("kvrelay:a", maxSurge=surge)
    new_spec = _spec(image, decode, maxSurge=surge)
    old, new = cluster_of(old_spec), cluster_of(new_spec)
    fake.put(SVC, service_body(old_spec))
    now = _run_until_serving(fake, kube, cluster, T0)
    assert cluster.placed() == 4 == cluster.slots  # no spare slot for a second copy
    served_before = cluster.served

    _edit(fake, new_spec, generation=2)
    most_pods, least_serving, phases = 0, 4, []
    for _ in range(200):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
        status = fake.objects[SVC]["status"]
        phases.append(status["rollout"]["phase"])
        most_pods = max(most_pods, len(cluster.worker_pods()))
        serving = status["generation"]
        least_serving = min(least_serving, cluster.ready_workers(serving))
        if status["rollout"]["phase"] == "Complete" and cluster.placed() == 4:
            break
    else:
        raise AssertionError(f"the roll did not finish: {fake.objects[SVC]['status']}")

    assert cluster.failed == []
    assert cluster.random_deletions == []  # every old worker left by name, drained
    # Every request that arrived was served or is still streaming; the roll took a while.
    assert cluster.arrived == cluster.served + len(cluster.streams)
    assert cluster.served - served_before >= 2 * len(phases) - cluster.length * 2
    assert len(phases) >= 10
    assert most_pods <= 4 + surge  # the pools' sizes plus maxSurge, Pending pods included
    assert least_serving >= 2  # a prefill and a decode worker serve throughout
    assert len(cluster.router.drains()) >= 2  # the old revision shrank through the routers
    assert phases.index("Rolling") < phases.index("Switched") < phases.index("Complete")
    assert _clusters(fake) == [new]
    assert old not in _clusters(fake)
    assert _groups(fake, new) == {"prefill": 2, "decode": 2}
    status = fake.objects[SVC]["status"]
    assert status["generation"] == revision_hash(service(new_spec))
    _reconcile(fake, kube, cluster, now)  # the status reads the last tick's pods
    assert _conditions(fake)["Progressing"] == ("True", "NewRevisionAvailable")
    assert _conditions(fake)["Ready"] == ("True", "AllReady")
    # Every running pod is the new revision's, made from the new template.
    (decode_group,) = [
        g
        for g in fake.objects[f"{RAYS}/{new}"]["spec"]["workerGroupSpecs"]
        if g["groupName"] == "decode"
    ]
    container = decode_group["template"]["spec"]["containers"][0]
    assert container["image"] == image
    if decode == GPUS:
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert decode_group["rayStartParams"]["num-gpus"] == "2"
    assert {p["metadata"]["labels"]["ray.io/cluster"] for p in cluster.worker_pods()} == {new}


def test_the_routers_stay_on_the_old_revision_until_the_new_one_can_serve(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    fake, kube, cluster = sim
    old_spec, new_spec = _spec("kvrelay:a"), _spec("kvrelay:b")
    old_rev = revision_hash(service(old_spec))
    fake.put(SVC, service_body(old_spec))
    now = _run_until_serving(fake, kube, cluster, T0)
    _edit(fake, new_spec, generation=2)
    deployment = "/apis/apps/v1/namespaces/llm/deployments/demo-router"
    for _ in range(200):
        _reconcile(fake, kube, cluster, now)
        status = fake.objects[SVC]["status"]
        if status["rollout"]["phase"] != "Rolling":
            break
        template = fake.objects[deployment]["spec"]["template"]
        assert template["metadata"]["labels"]["kvrelay.io/generation"] == old_rev
        assert status["generation"] == old_rev
        cluster.tick()
        now += TICK
    new_groups = _groups(fake, cluster_of(new_spec))
    assert new_groups["prefill"] >= 1 and new_groups["decode"] >= 1


def _stuck_roll(fake: FakeApi, kube: Kube, cluster: ClusterSim, **upgrade: Any) -> float:
    """A new revision whose decode pods fit no node; returns the time once it is stuck."""
    old_spec = _spec("kvrelay:a", None, progressDeadlineSeconds=60, **upgrade)
    new_spec = _spec("kvrelay:b", None, progressDeadlineSeconds=60, **upgrade)
    new_rev = revision_hash(service(new_spec))
    cluster.blocked = lambda revision, pool: revision == new_rev and pool == "decode"
    fake.put(SVC, service_body(old_spec))
    now = _run_until_serving(fake, kube, cluster, T0)
    _edit(fake, new_spec, generation=2)
    for _ in range(60):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
        if _conditions(fake).get("Progressing", ("",))[0] == "False":
            return now
    raise AssertionError(f"never reported: {fake.objects[SVC]['status']}")


def test_a_stuck_revision_is_reported_past_its_deadline(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    fake, kube, cluster = sim
    _stuck_roll(fake, kube, cluster)
    assert _conditions(fake)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    progressing = next(
        c for c in fake.objects[SVC]["status"]["conditions"] if c["type"] == "Progressing"
    )
    assert "autoRollback" in progressing["message"]
    assert "unschedulable" in progressing["message"]
    events = [o for p, o in fake.objects.items() if p.startswith(f"{EVENTS}/")]
    assert [(e["type"], e["reason"]) for e in events] == [("Warning", "ProgressDeadlineExceeded")]
    assert events[0]["involvedObject"]["kind"] == "KVRelayService"
    # The old revision still serves at its minimum, and keeps serving: nothing failed.
    assert cluster.failed == []
    old = cluster_of(_spec("kvrelay:a", None, progressDeadlineSeconds=60))
    assert _groups(fake, old) == {"prefill": 1, "decode": 1}
    # Without autoRollback it waits (room may come): a second reconcile makes no second Event.
    _reconcile(fake, kube, cluster, T0 + 10_000)
    assert len([p for p in fake.objects if p.startswith(f"{EVENTS}/")]) == 1


def test_an_event_that_cannot_be_posted_does_not_stop_the_report(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    fake, kube, cluster = sim
    fake.failures[("POST", EVENTS)] = 403  # a chart without events rights
    _stuck_roll(fake, kube, cluster)
    assert _conditions(fake)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert _conditions(fake)["Ready"][1] != "ApplyFailed"
    assert any(r.method == "POST" and r.path == EVENTS for r in fake.requests)


def test_auto_rollback_restores_the_old_revision_and_removes_the_new(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    fake, kube, cluster = sim
    now = _stuck_roll(fake, kube, cluster, autoRollback=True)
    assert _conditions(fake)["Progressing"] == ("False", "RolledBack")
    old_spec = _spec("kvrelay:a", None, progressDeadlineSeconds=60, autoRollback=True)
    new_spec = _spec("kvrelay:b", None, progressDeadlineSeconds=60, autoRollback=True)
    old, new = cluster_of(old_spec), cluster_of(new_spec)
    for _ in range(20):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
    assert _clusters(fake) == [old]
    assert _groups(fake, old) == {"prefill": 2, "decode": 2}
    assert cluster.placed() == 4
    status = fake.objects[SVC]["status"]
    assert status["generation"] == revision_hash(service(old_spec))
    assert status["rollout"]["phase"] == "RolledBack"
    assert _conditions(fake)["Ready"] == ("True", "AllReady")
    reasons = sorted(o["reason"] for p, o in fake.objects.items() if p.startswith(f"{EVENTS}/"))
    assert reasons == ["RolledBack"]  # the deadline's event is folded into the rollback's
    assert cluster.failed == []

    # The next edit of the spec tries again (here: the same revision, room still missing).
    _edit(fake, new_spec, generation=3)
    _reconcile(fake, kube, cluster, now)
    assert fake.objects[SVC]["status"]["rollout"]["phase"] == "Rolling"
    assert new in _clusters(fake)


def test_the_old_cluster_is_resized_as_the_api_holds_it() -> None:
    """The old revision's RayCluster was rendered from an older spec: only its sizes and the
    pods to delete change, every other field is sent back as read."""
    from kvrelay_operator.desired import desired_objects
    from kvrelay_operator.drain import Step
    from kvrelay_operator.rollout import resized_cluster
    from tests.deploy.schemas import validate_everywhere

    (live,) = [
        o for o in desired_objects(service(_spec("kvrelay:a")), {}) if o["kind"] == "RayCluster"
    ]
    live["metadata"]["resourceVersion"] = "42"  # the server's, never sent back
    steps = {"prefill": Step(1, ("p-1",)), "decode": Step(2)}
    body = resized_cluster(live, steps)
    assert "resourceVersion" not in body["metadata"]
    groups = {g["groupName"]: g for g in body["spec"]["workerGroupSpecs"]}
    assert groups["prefill"]["replicas"] == 1
    assert groups["prefill"]["scaleStrategy"] == {"workersToDelete": ["p-1"]}
    assert groups["decode"]["replicas"] == 2 and "scaleStrategy" not in groups["decode"]
    for name in ("prefill", "decode"):
        before = next(g for g in live["spec"]["workerGroupSpecs"] if g["groupName"] == name)
        assert groups[name]["template"] == before["template"]
    assert body["spec"]["headGroupSpec"] == live["spec"]["headGroupSpec"]
    validate_everywhere(body)


def test_one_pair_with_no_surge_and_no_room_waits_and_is_reported(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    """One prefill and one decode worker, maxSurge 0, two slots: draining either old worker
    would leave no one to serve, so the roll asks for one new pair beside them (rolling.py)
    and, with no room for it, waits and says so; the old pair serves throughout."""
    fake, kube, cluster = sim
    cluster.slots = 2
    one = {"replicas": 1, "drainTimeoutSeconds": 60}
    upgrade = {"maxSurge": 0, "progressDeadlineSeconds": 60}

    def spec(image: str) -> dict[str, Any]:
        return {"image": image, "prefill": one, "decode": one, "router": {"replicas": 1}} | {
            "upgrade": upgrade
        }

    fake.put(SVC, service_body(spec("kvrelay:a")))
    now = _run_until_serving(fake, kube, cluster, T0)
    _edit(fake, spec("kvrelay:b"), generation=2)
    for _ in range(20):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
    new = cluster_of(spec("kvrelay:b"))
    assert _groups(fake, new) == {"prefill": 1, "decode": 1}  # the one pair, Pending
    assert _groups(fake, cluster_of(spec("kvrelay:a"))) == {"prefill": 1, "decode": 1}
    assert len(cluster.worker_pods()) == 4 and cluster.placed() == 2
    assert _conditions(fake)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert cluster.router.drains() == []
    assert cluster.failed == [] and cluster.served > 20


def test_a_blue_green_copy_with_no_room_is_reported_and_the_spec_put_back_rolls_back(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    """BlueGreen on a full cluster: the second copy stays Pending, the old routers keep
    serving (a new router is not ready without a worker), the deadline reports it; putting
    the spec back removes the new copy."""
    fake, kube, cluster = sim
    upgrade = {"strategy": "BlueGreen", "progressDeadlineSeconds": 60}
    old_spec, new_spec = _spec("kvrelay:a", None, **upgrade), _spec("kvrelay:b", None, **upgrade)
    fake.put(SVC, service_body(old_spec))
    now = _run_until_serving(fake, kube, cluster, T0)
    _edit(fake, new_spec, generation=2)
    for _ in range(20):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
    new = cluster_of(new_spec)
    assert _groups(fake, new) == {"prefill": 2, "decode": 2}  # a whole second copy
    assert cluster.placed() == 4 and len(cluster.worker_pods()) == 8
    assert _conditions(fake)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    progressing = next(
        c for c in fake.objects[SVC]["status"]["conditions"] if c["type"] == "Progressing"
    )
    assert "0/4 new workers ready" in progressing["message"]
    assert "strategy Rolling" in progressing["message"]
    events = [o["reason"] for p, o in fake.objects.items() if p.startswith(f"{EVENTS}/")]
    assert events == ["ProgressDeadlineExceeded"]

    _edit(fake, old_spec, generation=3)
    for _ in range(5):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
    _reconcile(fake, kube, cluster, now)
    assert _clusters(fake) == [cluster_of(old_spec)]
    assert _conditions(fake)["Progressing"] == ("True", "NewRevisionAvailable")
    assert _conditions(fake)["Ready"] == ("True", "AllReady")
    assert cluster.failed == []


def test_putting_the_spec_back_mid_roll_restores_the_old_revision(
    sim: tuple[FakeApi, Kube, ClusterSim],
) -> None:
    """The rollback on request without autoRollback: the old spec is the spec's revision
    again, so the half-grown new RayCluster (no router ever used it) goes and the old one
    grows back to the pools' sizes."""
    fake, kube, cluster = sim
    now = _stuck_roll(fake, kube, cluster)
    old_spec = _spec("kvrelay:a", None, progressDeadlineSeconds=60)
    old = cluster_of(old_spec)
    assert _groups(fake, old) == {"prefill": 1, "decode": 1}
    _edit(fake, old_spec, generation=3)
    for _ in range(10):
        _reconcile(fake, kube, cluster, now)
        cluster.tick()
        now += TICK
    _reconcile(fake, kube, cluster, now)
    assert _clusters(fake) == [old]
    assert _groups(fake, old) == {"prefill": 2, "decode": 2}
    assert cluster.placed() == 4
    assert _conditions(fake)["Progressing"] == ("True", "NewRevisionAvailable")
    assert _conditions(fake)["Ready"] == ("True", "AllReady")
    assert cluster.failed == [] and cluster.random_deletions == []
