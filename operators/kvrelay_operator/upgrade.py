"""`spec.upgrade`: how a KVRelayService moves to a new worker revision. Parsing only; the
roll itself is planned in `rolling.py` and sequenced in `rollout.py`.

Two strategies:
    Rolling (the default)  the new revision's RayCluster starts small and grows while the old
                           one shrinks by draining, at most `maxSurge` worker pods over the
                           pools' sizes: fits a cluster with no room for a second copy.
    BlueGreen              the new RayCluster starts at full size beside the old one (twice
                           the workers for a while); the routers move when it serves.

A roll that makes no progress for `progressDeadlineSeconds` is reported (condition
Progressing=False, reason ProgressDeadlineExceeded, and a Warning event); with `autoRollback`
the old revision is then scaled back to its size and the new one removed.

When a service rolls is its spec's business: the operator's own version is no part of the
revision (revision.py), and a pinned `spec.image` ignores the operator's default image, so a
`helm upgrade` of the operator rolls only services that leave `spec.image` empty (or whose
pods it renders differently). How those follow a new default image is `followOperatorDefaults`
(default_gate.py): Immediate, OneAtATime (one such service rolls at a time across the watched
namespaces) or Never (the old default image stays until this is changed or the image pinned).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay_operator.errors import SpecError

ROLLING = "Rolling"
BLUE_GREEN = "BlueGreen"
STRATEGIES = (ROLLING, BLUE_GREEN)
IMMEDIATE, ONE_AT_A_TIME, NEVER = "Immediate", "OneAtATime", "Never"
FOLLOW_MODES = (IMMEDIATE, ONE_AT_A_TIME, NEVER)
# One extra worker pod: a roll then never needs more than one free GPU slot, and where even
# that is missing the old revision makes room by draining (rolling.py).
DEFAULT_MAX_SURGE = 1
# Longer than a pool's default drain timeout (300 s): one slow drain is not "stuck".
DEFAULT_PROGRESS_DEADLINE_S = 900


@dataclass(frozen=True)
class UpgradeSpec:
    strategy: str = ROLLING
    max_surge: int = DEFAULT_MAX_SURGE
    progress_deadline_s: int = DEFAULT_PROGRESS_DEADLINE_S
    auto_rollback: bool = False
    follow_defaults: str = ONE_AT_A_TIME

    @property
    def rolling(self) -> bool:
        return self.strategy == ROLLING

    @staticmethod
    def parse(raw: Mapping[str, Any]) -> UpgradeSpec:
        """`spec.upgrade`, checked.

        Raises:
            SpecError: an unknown strategy or follow mode, a negative surge or a deadline
                under a minute.
        """
        upgrade = UpgradeSpec(
            strategy=str(raw.get("strategy", ROLLING)),
            max_surge=_int(raw, "maxSurge", DEFAULT_MAX_SURGE),
            progress_deadline_s=_int(raw, "progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE_S),
            auto_rollback=bool(raw.get("autoRollback", False)),
            follow_defaults=str(raw.get("followOperatorDefaults", ONE_AT_A_TIME)),
        )
        if upgrade.strategy not in STRATEGIES:
            raise SpecError(
                f"upgrade.strategy {upgrade.strategy!r} is not one of {', '.join(STRATEGIES)}"
            )
        if upgrade.follow_defaults not in FOLLOW_MODES:
            raise SpecError(
                f"upgrade.followOperatorDefaults {upgrade.follow_defaults!r} is not one of "
                f"{', '.join(FOLLOW_MODES)}"
            )
        if upgrade.max_surge < 0:
            raise SpecError(f"upgrade.maxSurge must be >= 0, got {upgrade.max_surge}")
        if upgrade.progress_deadline_s < 60:
            raise SpecError(
                "upgrade.progressDeadlineSeconds must be at least 60 (a worker loads its model "
                f"first), got {upgrade.progress_deadline_s}"
            )
        return upgrade


def _int(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"upgrade.{key} must be an integer, got {value!r}")
    return value
