"""Routing: the prefix index, the filter -> score -> pick pipeline, round-robin, and the
disaggregation decision — pure functions over worker states."""

from __future__ import annotations

from collections import Counter

import pytest

from kvrelay.common.messages import EngineStats, WorkerInfo
from kvrelay.router.decision import Decision, decide
from kvrelay.router.policy import RouteQuery, RoutingPolicy
from kvrelay.router.prefix_index import PrefixIndex
from kvrelay.router.request_errors import UnavailableError
from kvrelay.router.workers import WorkerState


def worker(
    name: str, *, waiting: int = 0, in_flight: int = 0, free: int = 100, usage: float = 0.0
) -> WorkerState:
    info = WorkerInfo("decode", name, 1, 16, ("m",), 100, 2048)
    stats = EngineStats(
        num_running=0,
        num_waiting=waiting,
        num_free_blocks=free,
        num_blocks=100,
        kv_usage=usage,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
    )
    return WorkerState(None, info, stats, in_flight=in_flight)


HASHES = [bytes([i]) * 4 for i in range(8)]


def test_prefix_index_counts_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.replace("a", HASHES[:3] + HASHES[5:6])
    assert index.matched_blocks("a", HASHES) == 3  # block 5 alone is no prefix
    assert index.matched_blocks("b", HASHES) == 0
    index.record("b", HASHES[:6])
    assert index.matched_blocks("b", HASHES) == 6
    index.replace("b", [])  # the worker's own report wins (it evicted them)
    assert index.matched_blocks("b", HASHES) == 0
    index.remove("a")
    assert index.matched_blocks("a", HASHES) == 0


def test_prefix_overlap_wins_over_a_slightly_shorter_queue() -> None:
    index = PrefixIndex()
    hot, cold = worker("hot", in_flight=1), worker("cold")
    index.replace("hot", HASHES)
    picked = RoutingPolicy().pick([cold, hot], RouteQuery(HASHES, 10), index)
    assert picked is hot


def test_without_overlap_the_least_loaded_wins() -> None:
    busy, idle = worker("busy", waiting=5, usage=0.6), worker("idle", usage=0.1)
    picked = RoutingPolicy().pick([busy, idle], RouteQuery(HASHES, 10), PrefixIndex())
    assert picked is idle


def test_a_worker_without_kv_room_is_filtered_out() -> None:
    index = PrefixIndex()
    full = worker("full", free=2, in_flight=3)
    roomy = worker("roomy", in_flight=4)
    index.replace("full", HASHES)  # would win on overlap alone
    assert RoutingPolicy().pick([full, roomy], RouteQuery(HASHES, 10), index) is roomy
    # When no worker has room, the best of them all still gets it (it will queue there).
    assert RoutingPolicy().pick([full], RouteQuery(HASHES, 10), index) is full


def test_ties_share_the_load_and_round_robin_ignores_scores() -> None:
    workers = [worker("a"), worker("b"), worker("c")]
    scored = RoutingPolicy()
    picks = Counter(
        scored.pick(workers, RouteQuery([], 1), PrefixIndex()).worker_id for _ in range(9)
    )  # type: ignore[union-attr]
    assert picks == Counter({"a": 3, "b": 3, "c": 3})
    index = PrefixIndex()
    index.replace("a", HASHES)
    rr = RoutingPolicy("round_robin")
    order = [rr.pick(workers, RouteQuery(HASHES, 1), index).worker_id for _ in range(4)]  # type: ignore[union-attr]
    assert order == ["a", "b", "c", "a"]
    assert RoutingPolicy().pick([], RouteQuery([], 1), index) is None


def test_policy_configuration_is_checked() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="unknown scorers"):
        RoutingPolicy(weights={"magic": 1.0})


@pytest.mark.parametrize(
    ("prompt", "cached", "roles", "expected"),
    [
        (500, 0, {"prefill", "decode"}, Decision.DISAGGREGATED),
        (40, 0, {"prefill", "decode"}, Decision.DECODE_ONLY),  # short prompt
        (500, 480, {"prefill", "decode"}, Decision.DECODE_ONLY),  # cached at the decode worker
        (500, 0, {"decode"}, Decision.DECODE_ONLY),  # no prefill pool
        (500, 0, {"both"}, Decision.COLOCATED),
        (500, 0, {"both", "decode", "prefill"}, Decision.DISAGGREGATED),
    ],
)
def test_disaggregation_decision(
    prompt: int, cached: int, roles: set[str], expected: Decision
) -> None:
    assert decide(prompt, cached, roles, max_local_prefill_tokens=64) is expected


def test_no_decoding_worker_is_unavailable() -> None:
    with pytest.raises(UnavailableError, match="no decode"):
        decide(10, 0, {"prefill"}, 64)
