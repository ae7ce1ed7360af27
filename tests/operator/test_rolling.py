"""A Rolling upgrade's pure rules (rolling.py) and `spec.upgrade` (upgrade.py): the budget,
which pool grows or drains next, when the routers move, what a service of one pair with no
surge does, and the spec's checks."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay_operator.errors import SpecError
from kvrelay_operator.rolling import (
    RollStep,
    Side,
    budget,
    can_serve,
    capped_growth,
    next_pool,
    plan_roll,
)
from kvrelay_operator.upgrade import (
    DEFAULT_MAX_SURGE,
    DEFAULT_PROGRESS_DEADLINE_S,
    UpgradeSpec,
)
from tests.deploy.schemas import crd_schema
from tests.operator.services import service


def side(
    groups: tuple[int, int],
    ready: tuple[int, int] | None = None,
    unschedulable: tuple[int, int] = (0, 0),
) -> Side:
    """(prefill, decode) counts; pods exist for every group replica unless told."""
    ready = groups if ready is None else ready
    return Side(
        groups={"prefill": groups[0], "decode": groups[1]},
        ready={"prefill": ready[0], "decode": ready[1]},
        alive={"prefill": groups[0], "decode": groups[1]},
        unschedulable={"prefill": unschedulable[0], "decode": unschedulable[1]},
    )


def sizes(prefill: int, decode: int) -> dict[str, int]:
    return {"prefill": prefill, "decode": decode}


WANT = sizes(2, 2)


def test_the_new_revision_grows_a_serving_pair_first_within_the_surge() -> None:
    step = plan_roll(WANT, side((2, 2)), side((0, 0)), max_surge=1, old_draining=False)
    assert step == RollStep(new_groups=sizes(1, 0), old_wanted=sizes(2, 2))
    # At the budget (5): the new pod waits for room in prefill, so an old prefill drains.
    step = plan_roll(WANT, side((2, 2)), side((1, 0), (0, 0), (1, 0)), 1, False)
    assert step == RollStep(new_groups=sizes(1, 0), old_wanted=sizes(1, 2))


def test_a_starting_new_pod_or_a_drain_holds_the_old_revision() -> None:
    # The new pod is not unschedulable, just starting (pulling, loading): no drain yet.
    step = plan_roll(WANT, side((2, 2)), side((1, 0), (0, 0)), 1, False)
    assert step.old_wanted == sizes(2, 2) and step.waiting == "new workers are starting"
    draining = Side(groups=sizes(1, 2), ready=sizes(1, 2), alive=sizes(2, 2))
    step = plan_roll(WANT, draining, side((1, 0), (0, 0), (1, 0)), 1, old_draining=True)
    assert step.old_wanted == sizes(1, 2) and step.waiting == "an old worker is draining"


def test_nothing_beyond_one_new_pair_until_it_serves() -> None:
    """A roomy surge must not let a freed slot go to a second new prefill pod while the
    first new decode pod waits: the roll would stall with the old revision at its minimum."""
    step = plan_roll(WANT, side((1, 1)), side((1, 1), (1, 0), (0, 1)), 4, False)
    assert step.new_groups == sizes(1, 1)
    step = plan_roll(WANT, side((1, 1)), side((1, 1)), 4, False)
    assert step.switch


def test_a_draining_old_pod_still_counts_against_the_budget() -> None:
    old = Side(groups=sizes(1, 2), ready=sizes(1, 2), alive=sizes(2, 2))
    step = plan_roll(WANT, old, side((1, 0)), 1, old_draining=True)
    assert step.new_groups == sizes(1, 0)  # 2 + 2 old pods + 1 new = the budget of 5


def test_the_routers_move_at_the_crossover() -> None:
    step = plan_roll(WANT, side((1, 1)), side((1, 1)), 1, False)
    assert step.switch
    # A new pair is ready but the old revision is bigger: keep going (at the budget of 5:
    # drain an old prefill worker for the next new pod).
    step = plan_roll(WANT, side((2, 1)), side((1, 1)), 1, False)
    assert not step.switch and step.old_wanted == sizes(1, 1)
    step = plan_roll(WANT, side((2, 1)), side((1, 1)), 2, False)
    assert not step.switch and step.new_groups == sizes(2, 1)


def test_no_switch_while_a_new_pod_is_starting() -> None:
    step = plan_roll(WANT, side((1, 1)), side((1, 2), (1, 1)), 1, False)
    assert not step.switch


def test_the_old_revision_keeps_a_serving_pair_until_the_switch() -> None:
    # Old at one prefill and one decode, new cannot serve: nothing more is drained.
    step = plan_roll(WANT, side((1, 1)), side((1, 1), (1, 0), (0, 1)), 0, False)
    assert step.old_wanted == sizes(1, 1)
    assert not step.switch and "no room for a new serving pair" in step.waiting
    assert "1 new pod(s) unschedulable" in step.waiting


def test_one_pair_with_no_surge_still_gets_room_for_a_new_pair() -> None:
    """maxSurge 0 on one prefill and one decode: nothing can drain without leaving the old
    revision unable to serve, so the budget holds one new pair beside it (rolling.py)."""
    one = sizes(1, 1)
    assert budget(one, side((1, 1)), 0) == 4
    step = plan_roll(one, side((1, 1)), side((0, 0)), 0, False)
    assert step.new_groups == sizes(1, 0)
    step = plan_roll(one, side((1, 1)), side((1, 0)), 0, False)
    assert step.new_groups == sizes(1, 1)
    assert plan_roll(one, side((1, 1)), side((1, 1)), 0, False).switch


def test_a_decode_only_service_needs_no_prefill_to_serve() -> None:
    want = sizes(0, 2)
    assert can_serve(side((0, 1)), want)
    assert not can_serve(side((0, 1)), WANT)
    step = plan_roll(want, side((0, 2)), side((0, 0)), 1, False)
    assert step.new_groups == sizes(0, 1)
    assert budget(want, side((0, 2)), 0) == 2


@pytest.mark.parametrize(
    ("groups", "pool"),
    [
        ((0, 0), "prefill"),
        ((1, 0), "decode"),
        ((1, 1), "prefill"),
        ((2, 1), "decode"),
        ((2, 2), None),
    ],
)
def test_the_next_pool_is_the_empty_one_then_the_furthest_behind(
    groups: tuple[int, int], pool: str | None
) -> None:
    assert next_pool(WANT, sizes(*groups)) == pool
    assert next_pool(sizes(1, 4), sizes(1, 1)) == "decode"


def test_after_the_switch_growth_stays_within_the_budget() -> None:
    # The old revision still holds 2 pods: the new one (1, 1) may add 1 (2 + 2 + 1 = 5).
    assert capped_growth(WANT, sizes(1, 1), others=2, max_surge=1) == sizes(2, 1)
    assert capped_growth(WANT, sizes(1, 1), others=0, max_surge=0) == WANT
    # A shrink passes through (drain.py handles it).
    assert capped_growth(sizes(1, 1), sizes(2, 2), others=2, max_surge=0) == sizes(1, 1)


def _walk(want: dict[str, int], old_groups: tuple[int, int], surge: int, slots: int) -> int:
    """Step a roll where drains finish at once and pods start within a step, on `slots`
    worker slots; returns the steps to the switch, checking the invariants on the way."""
    old, new = side(old_groups), side((0, 0))
    for count in range(1, 50):
        step = plan_roll(want, old, new, surge, False)
        if step.switch:
            return count
        assert can_serve(old, want)  # the old revision serves until the switch
        total = sum(step.old_wanted.values()) + sum(step.new_groups.values())
        assert total <= max(sum(want.values()) + surge, 4)
        old = side((step.old_wanted["prefill"], step.old_wanted["decode"]))
        room = slots - sum(old.groups.values())
        placed = {p: 0 for p in ("prefill", "decode")}
        for pool in ("prefill", "decode"):
            placed[pool] = min(step.new_groups[pool], room)
            room -= placed[pool]
        groups = (step.new_groups["prefill"], step.new_groups["decode"])
        waiting = (groups[0] - placed["prefill"], groups[1] - placed["decode"])
        new = side(groups, (placed["prefill"], placed["decode"]), waiting)
    raise AssertionError("no switch")


@pytest.mark.parametrize("surge", [0, 1, 2, 4])
@pytest.mark.parametrize(("want", "slots"), [((2, 2), 4), ((3, 5), 8), ((1, 1), 4), ((0, 3), 3)])
def test_a_roll_always_reaches_the_switch(want: tuple[int, int], slots: int, surge: int) -> None:
    assert _walk(sizes(*want), want, surge, slots) < 30


def test_the_rollout_record_writes_every_field_of_the_schema() -> None:
    from kvrelay_operator.rollout import ROLLOUT_FIELDS, rollout_status

    status = crd_schema("KVRelayService")["properties"]["status"]["properties"]
    assert tuple(status["rollout"]["properties"]) == ROLLOUT_FIELDS
    # A field an earlier phase wrote is cleared (null in a merge patch), not left behind.
    assert rollout_status({"phase": "Rolling"})["specGeneration"] is None


def test_upgrade_defaults_match_the_crd() -> None:
    schema = crd_schema("KVRelayService")["properties"]["spec"]["properties"]["upgrade"]
    props = schema["properties"]
    assert props["strategy"]["default"] == "Rolling" == UpgradeSpec().strategy
    assert props["maxSurge"]["default"] == DEFAULT_MAX_SURGE == UpgradeSpec().max_surge
    assert props["progressDeadlineSeconds"]["default"] == DEFAULT_PROGRESS_DEADLINE_S
    assert props["autoRollback"]["default"] is False
    assert service({}).upgrade == UpgradeSpec()
    parsed = service({"upgrade": {"strategy": "BlueGreen", "maxSurge": 3}}).upgrade
    assert (parsed.strategy, parsed.max_surge, parsed.rolling) == ("BlueGreen", 3, False)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"strategy": "Recreate"}, "upgrade.strategy"),
        ({"maxSurge": -1}, "upgrade.maxSurge"),
        ({"maxSurge": "1"}, "upgrade.maxSurge"),
        ({"progressDeadlineSeconds": 10}, "upgrade.progressDeadlineSeconds"),
    ],
)
def test_a_bad_upgrade_section_names_its_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        UpgradeSpec.parse(raw)
