"""Deployment revisions in the router (no Ray): new requests go to one revision, the router's own
first; a prefill and a decode worker are only ever paired within one revision; draining
workers get nothing new; and the loopback check at introduction time."""

from __future__ import annotations

import logging

import pytest

from kvrelay.common.messages import PeerMetadata, Role, WorkerInfo
from kvrelay.router.kv_reach import unreachable_reason, warn_if_unreachable
from kvrelay.router.revisions import own_revision, pick_revision
from kvrelay.router.workers import WorkerRegistry, WorkerState

OLD, NEW = "0a1b2c3d4e5f", "f5e4d3c2b1a0"


def info(engine_id: str, role: Role, revision: str, pod: str = "") -> WorkerInfo:
    return WorkerInfo(
        role=role,
        engine_id=engine_id,
        epoch=1,
        block_size=4,
        hash_extra_keys=(),
        num_blocks=64,
        max_model_len=256,
        generation=revision,  # WorkerInfo's field (the workers' wire name)
        pod=pod or engine_id,
    )


def registry(own: str, *workers: WorkerInfo) -> WorkerRegistry:
    """A registry holding `workers` (no actors behind them: routing reads only its books)."""
    reg = WorkerRegistry(revision=own)
    for worker in workers:
        reg.workers[worker.engine_id] = WorkerState(None, worker)
    return reg


def mixed(own: str) -> WorkerRegistry:
    """Two revisions, each a full P/D deployment; the old one has more workers."""
    return registry(
        own,
        info("p-old", Role.PREFILL, OLD),
        info("d-old", Role.DECODE, OLD),
        info("d-old-2", Role.DECODE, OLD),
        info("p-new", Role.PREFILL, NEW),
        info("d-new", Role.DECODE, NEW),
    )


def ids(workers: list[WorkerState]) -> list[str]:
    return sorted(w.worker_id for w in workers)


@pytest.mark.parametrize("own", [OLD, NEW])
def test_a_router_sends_new_requests_to_its_own_revision(own: str) -> None:
    reg = mixed(own)
    assert reg.serving_revision() == own
    prefill, decode = reg.healthy(Role.PREFILL), reg.healthy(Role.DECODE)
    assert prefill and decode
    # Whatever the policy picks from these lists, P and D are of one revision: its own.
    assert {w.revision for w in prefill + decode} == {own}
    assert reg.roles() == {Role.PREFILL, Role.DECODE}
    assert reg.decode_token_capacity() == len(decode) * 64 * 4


def test_without_a_revision_of_its_own_it_takes_the_one_with_most_decoders() -> None:
    reg = mixed("")
    assert reg.serving_revision() == OLD
    assert ids(reg.healthy(Role.PREFILL)) == ["p-old"]
    assert ids(reg.healthy(Role.DECODE)) == ["d-old", "d-old-2"]


def test_its_own_revision_without_a_decoder_falls_back_to_another_whole_one() -> None:
    reg = mixed(NEW)
    reg.workers["d-new"].draining = True  # the new revision's only decoder goes away
    assert reg.serving_revision() == OLD
    assert {w.revision for w in reg.healthy(Role.PREFILL) + reg.healthy(Role.DECODE)} == {OLD}
    # Its decoder back: the router goes back to its own revision.
    reg.workers["d-new"].draining = False
    assert reg.serving_revision() == NEW


def test_a_revision_with_decoders_only_serves_whole_requests_on_them() -> None:
    """No prefill worker of its revision: no prefill from another is paired with it (the
    relay decides decode-only, as with an empty prefill pool)."""
    reg = registry(NEW, info("p-old", Role.PREFILL, OLD), info("d-new", Role.DECODE, NEW))
    assert reg.healthy(Role.PREFILL) == []
    assert reg.roles() == {Role.DECODE}


def test_an_explicit_revision_lists_that_one_whatever_serves() -> None:
    """What a migration asks for: a decode worker of the sample's own revision."""
    reg = mixed(NEW)
    assert ids(reg.healthy(Role.DECODE, revision=OLD)) == ["d-old", "d-old-2"]


def test_draining_and_unhealthy_workers_get_no_new_requests() -> None:
    reg = mixed(OLD)
    reg.workers["d-old"].draining = True
    reg.workers["d-old-2"].healthy = False
    assert reg.healthy(Role.DECODE) == [reg.workers["d-new"]]  # the only decoder left: NEW
    assert reg.serving_revision() == NEW


def test_a_laptop_registry_without_revisions_serves_everyone() -> None:
    reg = registry("", info("p", Role.PREFILL, ""), info("d", Role.DECODE, ""))
    assert ids(reg.healthy(Role.PREFILL) + reg.healthy(Role.DECODE)) == ["d", "p"]
    assert registry("").serving_revision() is None
    assert registry("").roles() == set()


def test_pick_revision_ties_break_the_same_way_everywhere() -> None:
    serving = [("b", Role.DECODE), ("a", Role.DECODE), ("a", Role.PREFILL), ("b", Role.BOTH)]
    assert pick_revision(serving, "") == "b"  # 2 each: the greatest name
    assert pick_revision(list(reversed(serving)), "") == "b"
    assert pick_revision(serving, "a") == "a"
    assert pick_revision([("a", Role.PREFILL)], "a") is None  # nobody can decode


def test_own_revision_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_GENERATION", f" {NEW} ")
    assert own_revision() == NEW
    assert WorkerRegistry().revision == NEW
    assert WorkerRegistry(revision="").revision == ""  # explicit: any revision
    monkeypatch.delenv("KVRELAY_GENERATION")
    assert WorkerRegistry().revision == ""


# -- can the decode worker reach the KV address the prefill worker advertises? --


def meta(address: str, backend: str = "grpc") -> PeerMetadata:
    return PeerMetadata("p", 1, backend, address.encode())


@pytest.mark.parametrize(
    ("address", "decode_pod", "reachable"),
    [
        ("127.0.0.1:5000", "pod-b", False),  # the defect: another pod dials its own loopback
        ("localhost:5000", "pod-b", False),
        ("[::1]:5000", "pod-b", False),
        ("127.0.0.1:5000", "pod-a", True),  # the same pod (or a laptop): fine
        ("10.1.2.3:5000", "pod-b", True),  # the pod IP
        ("kv.example:5000", "pod-b", True),  # a name: the puller resolves it
    ],
)
def test_a_loopback_kv_address_across_pods_is_called_out(
    address: str, decode_pod: str, reachable: bool
) -> None:
    prefill = info("p", Role.PREFILL, NEW, pod="pod-a")
    decode = info("d", Role.DECODE, NEW, pod=decode_pod)
    reason = unreachable_reason(meta(address), prefill, decode)
    assert (reason is None) is reachable
    if reason is not None:
        assert address in reason and "KVRELAY_KV_HOST" in reason and "pod-b" in reason


def test_the_call_out_is_a_warning_and_nixl_is_not_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill = info("p", Role.PREFILL, NEW, pod="pod-a")
    decode = info("d", Role.DECODE, NEW, pod="pod-b")
    with caplog.at_level(logging.WARNING, logger="kvrelay.router.kv_reach"):
        assert not warn_if_unreachable(meta("127.0.0.1:5000"), prefill, decode)
        assert warn_if_unreachable(meta("\x00opaque", backend="nixl"), prefill, decode)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "127.0.0.1:5000" in caplog.records[0].getMessage()


def test_failed_pulls_since_the_last_poll_are_counted() -> None:
    from kvrelay.common.messages import EngineStats
    from kvrelay.router.kv_reach import warn_of_fallbacks

    def stats(fallbacks: int, failures: int = 0) -> EngineStats:
        return EngineStats(
            0, 0, 64, 64, 0.0, 0, 0, 0, kv_pull_fallbacks=fallbacks, kv_transfer_failures=failures
        )

    decode = info("d", Role.DECODE, NEW)
    assert warn_of_fallbacks(decode, None, stats(5)) == 0  # first sight: no baseline
    assert warn_of_fallbacks(decode, stats(5), stats(5)) == 0
    assert warn_of_fallbacks(decode, stats(5), stats(7, 1)) == 3
