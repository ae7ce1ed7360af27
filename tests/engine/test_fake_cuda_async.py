"""Async scheduling on the CUDA code paths, on a CPU-only machine (tests/fake_cuda): step
n+1 is launched before step n's sampled ids are read, the read is the only device value the
host takes (from a pinned copy, after its event), graphs still replay, and the outputs and
the KV pool come out as without overlap. Scenarios: tests/fake_cuda/async_scenarios.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fake_cuda.async_scenarios import TOKENS
from tests.fake_cuda.report import run_scenarios
from tests.fake_cuda.scenarios import SAMPLED

pytestmark = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch (GPU tests cover it)"
)
REQUESTS = {"d0", "d1", "d2", "d3", "long", "seeded", "masked"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenarios(
        "tests.fake_cuda.async_scenarios", tmp_path_factory.mktemp("fake-cuda-async") / "r.json"
    )


def _result(report: dict[str, Any], name: str) -> dict[str, Any]:
    part = report[name]
    assert "error" not in part, part["error"]
    assert part["violations"] == [], part["violations"]
    result: dict[str, Any] = part["result"]
    return result


def _steps(log: list[str]) -> list[list[str]]:
    """The log cut at each step_delta call: what each call launched and read, in order."""
    steps: list[list[str]] = []
    for entry in log:
        if entry == "step":
            steps.append([])
        else:
            steps[-1].append(entry)
    return steps


@pytest.mark.parametrize("name", ["graphs", "eager"])
def test_each_step_launches_the_next_before_it_reads_the_last(
    report: dict[str, Any], name: str
) -> None:
    result = _result(report, name)
    steps = _steps(result["log"])
    # The first call only launches; each later one launches the next step, then reads the
    # one before; the last reads what is left (nothing more to launch).
    assert steps[0] == ["launch"]
    assert all(step == ["launch", "read"] for step in steps[1:-1]), steps
    assert steps[-1] == ["read"]
    launches = reads = 0
    for entry in result["log"]:
        launches += entry == "launch"
        reads += entry == "read"
        if entry == "read":
            assert launches >= reads + 1 or reads == len(steps) - 1
    assert result["launched"] == len(steps) - 1


@pytest.mark.parametrize("name", ["graphs", "eager"])
def test_outputs_and_the_pool_are_as_without_overlap(report: dict[str, Any], name: str) -> None:
    """Every request its six tokens; the one whose first token is a stop token gets that one
    only (its next row, launched before the read, is discarded); every block free."""
    result = _result(report, name)
    assert result["finished"] == {
        **{rid: [SAMPLED] * TOKENS for rid in REQUESTS},
        "stops": [SAMPLED],
    }
    assert result["pool_whole"]


@pytest.mark.parametrize("name", ["graphs", "eager"])
def test_a_step_waits_on_the_host_only_for_its_read_and_the_staging_refill(
    report: dict[str, Any], name: str
) -> None:
    """Host waits per call: the stager's refill (the last upload's event, which the
    synchronous engine waits on too) and the one read of the sampled ids; none else."""
    waits = _result(report, name)["waits_per_step"]
    assert waits[0] == 0 and waits[-1] == 1
    assert all(w <= 2 for w in waits), waits


def test_graphs_still_replay_under_overlap(report: dict[str, Any]) -> None:
    assert report["graphs"]["graph_replays"] > 0
    assert report["eager"]["graph_replays"] == 0
