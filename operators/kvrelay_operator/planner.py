"""The planner's rule: an SLO signal -> a pool's next replica count, and why.

Pure, with time passed in. Rules, first match wins:

    current outside [min, max]         -> clamp into bounds at once (no cooldown)
    no signal                          -> hold (NoMetrics)
    signal > target x (1 + tolerance)  -> up to ceil(current x signal / target), at least +1,
                                          at most max; not within the scale-up cooldown
    signal < target x (1 - tolerance)  -> down by one, not below min; not within the
                                          scale-down cooldown (measured from any change)
    otherwise                          -> hold (WithinTolerance)

Up is proportional because an overloaded pool should catch up in one step; down is one
worker at a time because latency does not fall in proportion to load, and an overshoot
downwards costs SLO violations while one upwards only costs a worker for a while.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrelay_operator.spec import Autoscaling


@dataclass(frozen=True)
class Decision:
    replicas: int
    action: str  # "up" | "down" | "hold"
    reason: str  # CamelCase, for events and status
    message: str

    @property
    def changes(self) -> bool:
        return self.action != "hold"


def _fmt(metric: str, value: float) -> str:
    return f"{value:.2f}" if metric == "kvUsage" else f"{value * 1000:.0f}ms"


def decide(
    auto: Autoscaling,
    current: int,
    signal: float | None,
    last_scale_time: float | None,
    now: float,
) -> Decision:
    """The pool's next size.

    Args:
        auto: bounds, target, tolerance and cooldowns.
        current: the pool's replicas now.
        signal: the SLO metric over the last interval (seconds, or a ratio for kvUsage).
        last_scale_time: when the planner last changed this pool (epoch seconds), or None.
        now: epoch seconds.
    """
    lo, hi = auto.min_replicas, auto.max_replicas
    if current < lo:
        return Decision(lo, "up", "BelowMinReplicas", f"{current} < minReplicas {lo}")
    if current > hi:
        return Decision(hi, "down", "AboveMaxReplicas", f"{current} > maxReplicas {hi}")
    if signal is None:
        return Decision(current, "hold", "NoMetrics", "no metrics from the routers yet")
    since = math.inf if last_scale_time is None else now - last_scale_time
    seen = f"{auto.metric} {_fmt(auto.metric, signal)} vs target {_fmt(auto.metric, auto.target)}"
    ratio = signal / auto.target
    if ratio > 1 + auto.tolerance:
        if current >= hi:
            return Decision(current, "hold", "AtMaxReplicas", f"{seen}; at maxReplicas {hi}")
        if since < auto.scale_up_cooldown_s:
            return Decision(current, "hold", "Cooldown", f"{seen}; scaled {since:.0f}s ago")
        want = min(hi, max(current + 1, math.ceil(current * ratio)))
        return Decision(want, "up", "AboveTarget", f"{seen}; {current} -> {want}")
    if ratio < 1 - auto.tolerance:
        if current <= lo:
            return Decision(current, "hold", "AtMinReplicas", f"{seen}; at minReplicas {lo}")
        if since < auto.scale_down_cooldown_s:
            return Decision(current, "hold", "Cooldown", f"{seen}; scaled {since:.0f}s ago")
        return Decision(current - 1, "down", "BelowTarget", f"{seen}; {current} -> {current - 1}")
    return Decision(current, "hold", "WithinTolerance", seen)
