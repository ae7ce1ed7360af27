"""Metrics -> planner decisions: scale up, down, hold at bounds, cooldown, hysteresis."""

from __future__ import annotations

import pytest

from kvrelay_operator.planner import decide
from kvrelay_operator.spec import Autoscaling

TTFT = Autoscaling(
    enabled=True,
    min_replicas=1,
    max_replicas=6,
    metric="ttft",
    target=0.5,
    tolerance=0.1,
    scale_up_cooldown_s=60,
    scale_down_cooldown_s=300,
)
KV = Autoscaling(
    enabled=True, min_replicas=2, max_replicas=4, metric="kvUsage", target=0.8, tolerance=0.05
)
NOW = 10_000.0

# (id, policy, current, signal, seconds since last scale or None, replicas, action, reason)
CASES = [
    ("up proportional", TTFT, 2, 1.0, None, 4, "up", "AboveTarget"),
    ("up at least one", TTFT, 2, 0.6, None, 3, "up", "AboveTarget"),
    ("up capped at max", TTFT, 4, 5.0, None, 6, "up", "AboveTarget"),
    ("hold at max", TTFT, 6, 5.0, None, 6, "hold", "AtMaxReplicas"),
    ("up cooldown", TTFT, 2, 1.0, 30.0, 2, "hold", "Cooldown"),
    ("up after cooldown", TTFT, 2, 1.0, 61.0, 4, "up", "AboveTarget"),
    ("within upper tolerance", TTFT, 3, 0.54, None, 3, "hold", "WithinTolerance"),
    ("within lower tolerance", TTFT, 3, 0.46, None, 3, "hold", "WithinTolerance"),
    ("down one step", TTFT, 5, 0.1, None, 4, "down", "BelowTarget"),
    ("idle pool goes down", TTFT, 3, 0.0, 400.0, 2, "down", "BelowTarget"),
    ("down cooldown", TTFT, 5, 0.1, 200.0, 5, "hold", "Cooldown"),
    ("hold at min", TTFT, 1, 0.1, None, 1, "hold", "AtMinReplicas"),
    ("no metrics", TTFT, 3, None, None, 3, "hold", "NoMetrics"),
    ("below min ignores cooldown", TTFT, 0, None, 1.0, 1, "up", "BelowMinReplicas"),
    ("above max ignores cooldown", TTFT, 9, 0.5, 1.0, 6, "down", "AboveMaxReplicas"),
    ("kv usage high", KV, 2, 0.95, None, 3, "up", "AboveTarget"),
    ("kv usage in band", KV, 3, 0.78, None, 3, "hold", "WithinTolerance"),
    ("kv usage low", KV, 3, 0.2, None, 2, "down", "BelowTarget"),
    ("kv usage low at min", KV, 2, 0.2, None, 2, "hold", "AtMinReplicas"),
]


@pytest.mark.parametrize(
    ("policy", "current", "signal", "since", "replicas", "action", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide(
    policy: Autoscaling,
    current: int,
    signal: float | None,
    since: float | None,
    replicas: int,
    action: str,
    reason: str,
) -> None:
    last = None if since is None else NOW - since
    decision = decide(policy, current, signal, last, NOW)
    assert (decision.replicas, decision.action, decision.reason) == (replicas, action, reason)
    assert decision.changes == (action != "hold")
    assert policy.min_replicas <= decision.replicas <= policy.max_replicas
    assert decision.message


def test_message_says_why_in_the_target_unit() -> None:
    up = decide(TTFT, 2, 1.0, None, NOW)
    assert up.message == "ttft 1000ms vs target 500ms; 2 -> 4"
    kv = decide(KV, 3, 0.2, None, NOW)
    assert kv.message == "kvUsage 0.20 vs target 0.80; 3 -> 2"


def test_repeated_ticks_converge_and_respect_cooldown() -> None:
    """A sustained overload scales up, waits out the cooldown, then goes on; load gone, it
    steps down one worker per scale-down cooldown to the minimum."""
    current, last, t = 1, None, 0.0
    history = []
    for _ in range(40):  # 40 ticks of 15 s under a TTFT of 3x the target
        decision = decide(TTFT, current, 1.5, last, t)
        if decision.changes:
            current, last = decision.replicas, t
            history.append((t, current))
        t += 15
    assert history == [(0.0, 3), (60.0, 6)]
    downs = []
    for _ in range(200):
        decision = decide(TTFT, current, 0.05, last, t)
        if decision.changes:
            current, last = decision.replicas, t
            downs.append(current)
        t += 15
    assert downs == [5, 4, 3, 2, 1]
