"""A new operator default image rolls the services that follow it one at a time
(default_gate.py): three services with `spec.image` empty, each on its own toy cluster with
no spare slot (cluster_sim.py, streaming through every roll), one fake API server and one
operator reconciling them all. A user's edit is never gated; a restarted operator carries
on from what the API holds; Immediate and Never do what they say."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import kubernetes
import pytest

from kvrelay_operator.errors import SpecError
from kvrelay_operator.kube import Kube
from kvrelay_operator.reconcile import reconcile
from kvrelay_operator.revision import revision_hash
from kvrelay_operator.spec import ServiceSpec, parse_service
from tests.deploy.schemas import validate_custom
from tests.operator.cluster_sim import RAYS, ClusterSim
from tests.operator.fake_api import FakeApi, fake_api
from tests.operator.router_stub import router_stub
from tests.operator.services import service_body

OLD, NEW = "registry.example/kvrelay:0.1.0", "registry.example/kvrelay:0.2.0"
NAMES = ("alpha", "beta", "gamma")
T0 = 1_800_000_000.0
TICK = 5.0


def _path(name: str) -> str:
    return f"/apis/kvrelay.io/v1alpha1/namespaces/llm/kvrelayservices/{name}"


def _spec(**upgrade: Any) -> dict[str, Any]:
    pool = {"replicas": 2, "drainTimeoutSeconds": 60}
    # No image: each follows the operator's default. One router pod per revision (the sim).
    return {"prefill": pool, "decode": dict(pool), "upgrade": upgrade, "router": {"replicas": 1}}


@dataclass
class Fleet:
    """Three services, their clusters and the operator's default image."""

    fake: FakeApi
    kube: Kube
    sims: dict[str, ClusterSim]
    default: str = OLD
    watched: tuple[str, ...] | None = None
    now: float = T0
    history: list[dict[str, tuple[str, str, str]]] = field(default_factory=list)

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.fake.objects[_path(name)].get("status") or {})

    def roll(self, name: str) -> tuple[str, str]:
        record = self.status(name).get("rollout") or {}
        return str(record.get("trigger", "")), str(record.get("phase", ""))

    def progressing(self, name: str) -> tuple[str, str]:
        for c in self.status(name).get("conditions") or ():
            if c["type"] == "Progressing":
                return c["reason"], c["message"]
        return "", ""

    def round(self) -> None:
        """One reconcile of every service, then what each cluster does meanwhile."""
        for name, sim in self.sims.items():
            reconcile(
                self.kube,
                self.fake.objects[_path(name)],
                self.default,
                self.now,
                router_url=_router_url(sim),
                watched=self.watched,
            )
            validate_custom(self.fake.objects[_path(name)])  # the status fits the CRD
        for sim in self.sims.values():
            sim.tick()
        self.now += TICK
        self.history.append({n: (*self.roll(n), self.progressing(n)[0]) for n in self.sims})

    def settled(self, image: str) -> bool:
        return all(
            self.roll(n)[1] in ("", "Complete")
            and self.status(n).get("generation") == self.revision(n, image)
            and sim.placed() == 4
            for n, sim in self.sims.items()
        )

    def revision(self, name: str, image: str) -> str:
        return revision_hash(parse_service(self.fake.objects[_path(name)], image))

    def run_until_settled(self, image: str, rounds: int = 400) -> None:
        for _ in range(rounds):
            self.round()
            if self.settled(image):
                return
        raise AssertionError(f"not settled on {image}: {self.history[-1]}")

    def edit(self, name: str, spec: dict[str, Any]) -> None:
        body = self.fake.objects[_path(name)]
        generation = int(body["metadata"]["generation"]) + 1
        self.fake.put(
            _path(name), service_body(spec, name, generation=generation, status=body["status"])
        )

    def rolling(self, step: dict[str, tuple[str, str, str]]) -> list[str]:
        """The services rolling to the default image in one round of the history."""
        return [n for n, (trigger, phase, _) in step.items() if _defaults_roll(trigger, phase)]


def _router_url(sim: ClusterSim) -> Callable[[ServiceSpec], str]:
    return lambda _: sim.router.url


def _defaults_roll(trigger: str, phase: str) -> bool:
    return trigger == "OperatorDefaults" and phase in ("Rolling", "Switched")


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with ExitStack() as stack:
        fake, kube = stack.enter_context(fake_api())
        sims = {
            name: ClusterSim(fake, stack.enter_context(router_stub()), slots=4, service=name)
            for name in NAMES
        }
        yield Fleet(fake, kube, sims)


def _start(fleet: Fleet, spec: dict[str, Any] | None = None) -> None:
    """Every service serving on the old default image, then the operator's default moves."""
    for name in NAMES:
        fleet.fake.put(_path(name), service_body(spec or _spec(), name))
    fleet.run_until_settled(OLD, rounds=40)
    for name in NAMES:
        assert fleet.status(name)["image"]["rendered"] == OLD
    fleet.history.clear()
    fleet.default = NEW  # the operator restarts after a helm upgrade


def _segments(fleet: Fleet) -> list[str]:
    """The order in which services rolled to the default image, one entry per roll."""
    out: list[str] = []
    for step in fleet.history:
        for name in fleet.rolling(step):
            if not out or out[-1] != name:
                out.append(name)
    return out


def _assert_no_request_failed(fleet: Fleet) -> None:
    for sim in fleet.sims.values():
        assert sim.failed == []
        assert sim.random_deletions == []  # every old worker left by name, drained
        assert sim.arrived == sim.served + len(sim.streams)


def _assert_on(fleet: Fleet, name: str, image: str) -> None:
    status = fleet.status(name)
    assert status["generation"] == fleet.revision(name, image)
    assert status["image"]["rendered"] == image
    assert "newerDefault" not in status["image"]  # written null: dropped
    clusters = [p for p in fleet.fake.objects if p.startswith(f"{RAYS}/{name}-")]
    assert clusters == [f"{RAYS}/{name}-{fleet.revision(name, image)[:8]}"]
    sim = fleet.sims[name]
    for pod in sim.worker_pods():
        assert pod["metadata"]["labels"]["kvrelay.io/generation"] == status["generation"]


def test_a_new_default_image_rolls_one_service_at_a_time(fleet: Fleet) -> None:
    _start(fleet)
    fleet.run_until_settled(NEW)

    assert max(len(fleet.rolling(step)) for step in fleet.history) == 1
    assert _segments(fleet) == list(NAMES)  # each finished before the next began
    for name in NAMES:
        _assert_on(fleet, name, NEW)
    _assert_no_request_failed(fleet)
    # While one rolled, the others said why they waited, naming it.
    waits = [
        (name, rolling)
        for step in fleet.history
        for rolling in fleet.rolling(step)
        for name, (_, phase, reason) in step.items()
        if phase == "Waiting" and reason == "WaitingForOtherUpgrade"
    ]
    assert {(n, r) for n, r in waits} >= {("beta", "alpha"), ("gamma", "alpha"), ("gamma", "beta")}


def test_a_waiting_service_names_the_rolling_one_and_renders_the_old_image(fleet: Fleet) -> None:
    _start(fleet)
    while "alpha" not in fleet.rolling(fleet.history[-1] if fleet.history else {}):
        fleet.round()
    fleet.round()
    reason, message = fleet.progressing("beta")
    assert reason == "WaitingForOtherUpgrade"
    assert "llm/alpha is rolling to the operator's default image" in message
    status = fleet.status("beta")
    assert status["image"] == {"rendered": OLD, "pinned": False, "newerDefault": NEW}
    assert status["rollout"]["to"] == fleet.revision("beta", NEW)
    assert status["rollout"]["from"] == status["generation"] == fleet.revision("beta", OLD)
    # Nothing of beta moved: one RayCluster, of the old revision, its pods on the old image.
    clusters = [p for p in fleet.fake.objects if p.startswith(f"{RAYS}/beta-")]
    assert clusters == [f"{RAYS}/beta-{fleet.revision('beta', OLD)[:8]}"]
    groups = fleet.fake.objects[clusters[0]]["spec"]["workerGroupSpecs"]
    assert {g["template"]["spec"]["containers"][0]["image"] for g in groups} == {OLD}
    # gamma queued after beta (same time, later name): it waits for alpha too.
    assert fleet.progressing("gamma")[0] == "WaitingForOtherUpgrade"


def test_a_spec_edit_during_the_gate_rolls_at_once(fleet: Fleet) -> None:
    _start(fleet)
    while not fleet.history or fleet.roll("alpha") != ("OperatorDefaults", "Rolling"):
        fleet.round()
    edited = {**_spec(), "decode": {"replicas": 2, "drainTimeoutSeconds": 60, "cpusPerWorker": 6}}
    fleet.edit("gamma", edited)
    fleet.round()
    assert fleet.roll("gamma") == ("Spec", "Rolling")
    assert fleet.roll("alpha") == ("OperatorDefaults", "Rolling")  # both at once
    assert fleet.progressing("beta")[0] == "WaitingForOtherUpgrade"
    fleet.run_until_settled(NEW)

    # gamma's edit took the new default with it; alpha then beta followed the default.
    assert _segments(fleet) == ["alpha", "beta"]
    assert max(len(fleet.rolling(step)) for step in fleet.history) == 1
    for name in NAMES:
        _assert_on(fleet, name, NEW)
    assert fleet.roll("gamma")[0] == "Spec"
    _assert_no_request_failed(fleet)


def test_a_restarted_operator_carries_on_from_the_api(fleet: Fleet) -> None:
    _start(fleet)
    fleet.watched = ("llm",)  # the namespaced operator lists each namespace it watches
    while not fleet.history or fleet.roll("alpha")[1] != "Rolling":
        fleet.round()
    fleet.round()
    # A new process: a new client, nothing remembered but what the API server holds.
    config = kubernetes.client.Configuration()
    config.host = fleet.kube._api.configuration.host
    fleet.kube = Kube(kubernetes.client.ApiClient(config))
    fleet.round()
    assert fleet.roll("alpha") == ("OperatorDefaults", "Rolling")
    assert fleet.roll("beta")[1] == fleet.roll("gamma")[1] == "Waiting"
    fleet.run_until_settled(NEW)

    assert _segments(fleet) == list(NAMES)
    assert max(len(fleet.rolling(step)) for step in fleet.history) == 1
    for name in NAMES:
        _assert_on(fleet, name, NEW)
    _assert_no_request_failed(fleet)


def test_a_rolled_back_default_roll_holds_the_queue_until_its_spec_is_edited(
    fleet: Fleet,
) -> None:
    spec = _spec(autoRollback=True, progressDeadlineSeconds=60)
    _start(fleet, spec)
    bad = fleet.revision("alpha", NEW)
    fleet.sims["alpha"].blocked = lambda revision, pool: revision == bad  # never placed
    for _ in range(100):
        fleet.round()
        if fleet.roll("alpha")[1] == "RolledBack":
            break
    else:
        raise AssertionError(f"alpha never rolled back: {fleet.status('alpha')}")
    for _ in range(3):
        fleet.round()
    reason, message = fleet.progressing("beta")
    assert reason == "WaitingForOtherUpgrade"
    assert "llm/alpha's roll to the operator's default image was rolled back" in message
    assert fleet.status("beta")["generation"] == fleet.revision("beta", OLD)
    # alpha serves its old revision, and its record says so.
    assert fleet.status("alpha")["generation"] == fleet.revision("alpha", OLD)
    assert fleet.status("alpha")["image"]["rendered"] == OLD
    fleet.history.clear()

    fleet.edit("alpha", {**spec, "image": OLD})  # pinned: the queue moves on
    fleet.run_until_settled(NEW)
    assert _segments(fleet) == ["beta", "gamma"]
    assert max(len(fleet.rolling(step)) for step in fleet.history) == 1
    assert fleet.status("alpha")["image"] == {"rendered": OLD, "pinned": True}
    for name in ("beta", "gamma"):
        _assert_on(fleet, name, NEW)
    _assert_no_request_failed(fleet)


def test_immediate_rolls_every_follower_at_once(fleet: Fleet) -> None:
    _start(fleet, _spec(followOperatorDefaults="Immediate"))
    fleet.round()
    assert fleet.rolling(fleet.history[-1]) == list(NAMES)
    fleet.run_until_settled(NEW)
    for name in NAMES:
        _assert_on(fleet, name, NEW)
    _assert_no_request_failed(fleet)


def test_never_keeps_the_old_default_until_the_spec_says_otherwise(fleet: Fleet) -> None:
    _start(fleet, _spec(followOperatorDefaults="Never"))
    for _ in range(5):
        fleet.round()
    for name in NAMES:
        status = fleet.status(name)
        assert status["generation"] == fleet.revision(name, OLD)
        assert status["image"] == {"rendered": OLD, "pinned": False, "newerDefault": NEW}
        assert fleet.roll(name)[1] in ("", "Complete")
    # Changing the mode is the user's edit: that service moves, the others stay.
    fleet.edit("beta", _spec(followOperatorDefaults="OneAtATime"))
    fleet.round()
    fleet.round()
    assert fleet.roll("beta") == ("OperatorDefaults", "Rolling")
    for _ in range(80):
        fleet.round()
        if fleet.status("beta").get("generation") == fleet.revision("beta", NEW):
            break
    else:
        raise AssertionError(f"beta did not move: {fleet.status('beta')}")
    assert fleet.status("alpha")["image"]["newerDefault"] == NEW
    assert fleet.status("alpha")["generation"] == fleet.revision("alpha", OLD)


def test_a_pinned_image_ignores_the_default(fleet: Fleet) -> None:
    pinned = {**_spec(), "image": OLD}
    _start(fleet, pinned)
    for _ in range(3):
        fleet.round()
    for name in NAMES:
        assert fleet.status(name)["image"] == {"rendered": OLD, "pinned": True}
        assert fleet.status(name)["generation"] == fleet.revision(name, OLD)
        assert fleet.roll(name)[1] in ("", "Complete")


def test_a_service_from_an_older_operator_follows_the_spec(fleet: Fleet) -> None:
    """No status.image (an operator before this record): nothing to tell a default change
    from an edit by, so it rolls as before (documented)."""
    _start(fleet)
    for name in NAMES:
        body = fleet.fake.objects[_path(name)]
        del body["status"]["image"]
    fleet.round()
    assert fleet.rolling(fleet.history[-1]) == []
    assert all(fleet.roll(n) == ("Spec", "Rolling") for n in NAMES)


def test_an_unknown_follow_mode_is_refused() -> None:
    body = service_body(_spec())
    body["spec"]["upgrade"]["followOperatorDefaults"] = "Sometimes"
    with pytest.raises(SpecError, match=r"upgrade\.followOperatorDefaults 'Sometimes'"):
        parse_service(body, NEW)
    with pytest.raises(Exception, match="Sometimes"):
        service_body(_spec(followOperatorDefaults="Sometimes"))  # the CRD refuses it too
