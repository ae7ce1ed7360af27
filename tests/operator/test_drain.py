"""Drain before shrink (defect 3, operator side): which pods a shrink removes, and the steps
from the router's drain to KubeRay's workersToDelete. Pure functions, time passed in."""

from __future__ import annotations

import pytest

from kvrelay_operator.drain import (
    DELETING,
    DRAINING,
    PodInfo,
    ScaleDown,
    Step,
    WorkerInfo,
    next_step,
    parse_workers,
    pick_pods,
)

PODS = [
    PodInfo("w-a", created="2026-11-29T10:00:00Z"),
    PodInfo("w-b", created="2026-11-29T10:05:00Z"),
    PodInfo("w-c", created="2026-11-29T10:10:00Z"),
]


def _worker(pod: str, in_flight: int = 0, state: str = "serving") -> WorkerInfo:
    return WorkerInfo(f"kvrelay-decode-{pod}", pod, state, in_flight)


def test_parse_workers_reads_the_admin_api_shape() -> None:
    payload = {
        "workers": [
            {
                "name": "kvrelay-decode-w-a",
                "role": "decode",
                "pod": "w-a",
                "node": "n1",
                "generation": "abc",
                "state": "draining",
                "in_flight": 0,
            }
        ]
    }
    (worker,) = parse_workers(payload)
    assert worker == WorkerInfo("kvrelay-decode-w-a", "w-a", "draining", 0)
    assert worker.drained
    with pytest.raises(ValueError):
        parse_workers({"items": []})


def test_drained_needs_draining_and_nothing_in_flight() -> None:
    assert not _worker("x", 0, "serving").drained
    assert not _worker("x", 2, "draining").drained
    assert _worker("x", 0, "draining").drained


def test_pick_prefers_not_ready_then_idle_then_newest() -> None:
    pods = [*PODS, PodInfo("w-d", ready=False, created="2026-11-29T09:00:00Z")]
    workers = [_worker("w-a", 0), _worker("w-b", 5), _worker("w-c", 0)]
    # Not ready first, then the idle ones, the newest of those first.
    assert pick_pods(pods, workers, 1) == ["w-d"]
    assert pick_pods(pods, workers, 2) == ["w-d", "w-c"]
    assert pick_pods(pods, workers, 3) == ["w-d", "w-c", "w-a"]
    # Without the router's view: newest first.
    assert pick_pods(PODS, None, 2) == ["w-c", "w-b"]


def test_pick_never_takes_a_terminating_pod() -> None:
    pods = [PodInfo("w-a"), PodInfo("w-b", terminating=True)]
    assert pick_pods(pods, None, 2) == ["w-a"]


def test_growing_is_immediate_and_needs_no_record() -> None:
    assert next_step(5, 3, None, PODS, None, 0.0, 300) == Step(group_replicas=5)
    assert next_step(3, 3, None, PODS, None, 0.0, 300) == Step(group_replicas=3)
    # No cluster yet (a new revision): it starts at the pool's size.
    assert next_step(2, None, None, [], None, 0.0, 300) == Step(group_replicas=2)


def test_a_shrink_starts_by_draining_and_holds_the_group() -> None:
    workers = [_worker("w-a", 3), _worker("w-b", 0), _worker("w-c", 1)]
    step = next_step(2, 3, None, PODS, workers, 100.0, 300)
    assert step.group_replicas == 3  # KubeRay must not pick a pod itself
    assert step.workers_to_delete == ()
    assert step.drain == ("w-b",)
    assert step.record == ScaleDown(("w-b",), 2, 3, DRAINING, 100.0)


def test_a_shrink_of_pods_never_created_needs_no_drain() -> None:
    # The group says 3 but only 2 pods exist: going to 2 loses nobody.
    step = next_step(2, 3, None, PODS[:2], None, 0.0, 300)
    assert step == Step(group_replicas=2)


def test_draining_waits_for_the_workers_then_deletes_exactly_them() -> None:
    record = ScaleDown(("w-b",), 2, 3, DRAINING, 100.0)
    busy = [_worker("w-a"), _worker("w-b", 2, "draining"), _worker("w-c")]
    step = next_step(2, 3, record, PODS, busy, 150.0, 300)
    assert (step.group_replicas, step.workers_to_delete, step.record) == (3, (), record)
    assert step.drain == ("w-b",)  # asked again: idempotent, covers a lost request
    done = [_worker("w-a"), _worker("w-b", 0, "draining"), _worker("w-c")]
    step = next_step(2, 3, record, PODS, done, 160.0, 300)
    assert step.group_replicas == 2
    assert step.workers_to_delete == ("w-b",)
    assert step.record is not None and step.record.phase == DELETING
    assert step.drain == ()


def test_a_worker_already_gone_counts_as_drained() -> None:
    record = ScaleDown(("w-b",), 2, 3, DRAINING, 100.0)
    step = next_step(2, 3, record, PODS, [_worker("w-a"), _worker("w-c")], 110.0, 300)
    assert step.workers_to_delete == ("w-b",)


def test_the_drain_timeout_ends_a_drain_even_with_requests_in_flight() -> None:
    record = ScaleDown(("w-b",), 2, 3, DRAINING, 100.0)
    busy = [_worker("w-b", 4, "draining")]
    assert next_step(2, 3, record, PODS, busy, 399.0, 300).workers_to_delete == ()
    assert next_step(2, 3, record, PODS, busy, 400.0, 300).workers_to_delete == ("w-b",)
    # A router that does not answer: only the timeout ends it.
    assert next_step(2, 3, record, PODS, None, 399.0, 300).workers_to_delete == ()
    assert next_step(2, 3, record, PODS, None, 400.0, 300).workers_to_delete == ("w-b",)


def test_shrinking_further_while_draining_drains_more() -> None:
    record = ScaleDown(("w-b",), 2, 3, DRAINING, 100.0)
    workers = [_worker("w-a", 1), _worker("w-b", 1, "draining"), _worker("w-c", 0)]
    step = next_step(1, 3, record, PODS, workers, 120.0, 300)
    assert step.record is not None
    assert step.record.pods == ("w-b", "w-c")
    assert step.record.replicas == 1
    assert step.drain == ("w-b", "w-c")
    assert step.group_replicas == 3


def test_deleting_keeps_the_list_until_the_pods_are_gone() -> None:
    record = ScaleDown(("w-b",), 2, 3, DELETING, 100.0)
    step = next_step(2, 2, record, PODS, None, 500.0, 300)
    assert (step.group_replicas, step.workers_to_delete) == (2, ("w-b",))
    assert step.record == record
    # Terminating still exists: keep it listed.
    terminating = [PODS[0], PodInfo("w-b", terminating=True), PODS[2]]
    assert next_step(2, 2, record, terminating, None, 500.0, 300).workers_to_delete == ("w-b",)
    gone = [PODS[0], PODS[2]]
    assert next_step(2, 2, record, gone, None, 510.0, 300) == Step(group_replicas=2)


def test_a_scale_up_during_a_drain_replaces_the_drained_pods() -> None:
    # Drained workers take no new requests: once drained they go, and KubeRay makes new ones.
    record = ScaleDown(("w-b",), 2, 3, DRAINING, 100.0)
    step = next_step(4, 3, record, PODS, [_worker("w-b", 1, "draining")], 110.0, 300)
    assert step.group_replicas == 4 and step.workers_to_delete == ()
    step = next_step(4, 3, record, PODS, [_worker("w-b", 0, "draining")], 120.0, 300)
    assert (step.group_replicas, step.workers_to_delete) == (4, ("w-b",))


def test_the_record_round_trips_through_the_status() -> None:
    record = ScaleDown(("w-b", "w-c"), 1, 3, DRAINING, 100.0)
    raw = record.to_status("1970-01-01T00:01:40Z")
    assert raw == {
        "pods": ["w-b", "w-c"],
        "replicas": 1,
        "from": 3,
        "phase": "Draining",
        "startedAt": "1970-01-01T00:01:40Z",
    }
    assert ScaleDown.from_status(raw, 100.0) == record
    assert ScaleDown.from_status(None, None) is None
    assert ScaleDown.from_status({"pods": []}, None) is None
