"""The decode dispatch in whole engines on fake CUDA (tests/fake_cuda/dispatch_scenarios.py,
run once in a process of its own): with KVRELAY_DECODE_ATTENTION pinned to each kernel and
with made-up timings, every decode launch is the kernel the table chose for its step, the
graphs are still captured (each with its batch's graph choice) and replayed, and every step
keeps issue 14's rules. Without injected timings nothing is timed on the rig."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrelay_kernels import decode_dispatch
from kvrelay_kernels.decode_dispatch import DecodeShape, choose_table
from tests.fake_cuda.report import run_scenarios
from tests.fake_cuda.scenarios import finished_run

LAUNCH_OF = {"cuda": "decode", "triton": "triton_decode"}  # the stand-ins' log names
GRAPH_SIZES = [1, 2, 4, 8]  # scenarios.MAX_NUM_SEQS = 8

pytestmark = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch (GPU tests cover it)"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenarios(
        "tests.fake_cuda.dispatch_scenarios",
        tmp_path_factory.mktemp("fake-cuda-dispatch") / "report.json",
    )


def paired_launches(result: dict[str, Any]) -> list[tuple[dict[str, Any], str, int]]:
    """Each choice with the first decode launch logged after it: (choice, launch, rows)."""
    launches = result["launches"]
    pairs = []
    for choice in result["choices"]:
        after = launches[choice["logged"] :]
        name, rows = next((n, r) for n, r in after if n in LAUNCH_OF.values())
        pairs.append((choice, name, rows))
    return pairs


def assert_launches_follow_choices(result: dict[str, Any]) -> None:
    pairs = paired_launches(result)
    assert pairs, "no decode step was chosen"
    for choice, name, rows in pairs:
        assert name == LAUNCH_OF[choice["kernel"]], (choice, name)
        assert rows == choice["batch"], (choice, rows)
    decode_launches = [n for n, _ in result["launches"] if n in LAUNCH_OF.values()]
    assert len(decode_launches) == len(pairs)  # no decode launch that no choice made


def assert_graphs_captured_and_replayed(report: dict[str, Any], name: str) -> None:
    result = report[name]["result"]
    assert result["graph_sizes"] == GRAPH_SIZES
    assert report[name]["runtime"]["graph_captures"] == len(GRAPH_SIZES)
    assert report[name]["runtime"]["graph_replays"] == len(result["replayed"]) > 0


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
def test_a_pinned_kernel_takes_every_decode_step_graphed_or_not(
    report: dict[str, Any], kernel: str
) -> None:
    name = f"pinned_{kernel}"
    result = finished_run(report, name)
    assert_launches_follow_choices(result)
    assert {c["kernel"] for c in result["choices"]} == {kernel}
    assert {c["graphed"] for c in result["choices"]} == {True, False}
    other = LAUNCH_OF["triton" if kernel == "cuda" else "cuda"]
    assert other not in {n for n, _ in result["launches"]}
    assert "triton" in {n for n, _ in result["launches"]}  # prefill rows stay on Triton
    assert_graphs_captured_and_replayed(report, name)
    assert result["tables"] == [
        f"decode attention (4/2 heads x 64 bfloat16, block 16): pinned, {kernel} for every step"
    ]
    counters = report[name]["counters"]
    if kernel == "triton":
        assert counters["cuda_decode_calls"] == 0 and counters["triton_decode_calls"] > 0
    else:
        assert counters["triton_decode_calls"] == 0 and counters["cuda_decode_calls"] > 0


def made_up_table(report: dict[str, Any]) -> decode_dispatch.DecodeTable:
    """The table the made-up timings make, computed here, apart from the engine's process."""
    timings = {}
    for key, seconds in report["timings"].items():
        kernel, batch, context = key.split("/")
        timings[(kernel, int(batch), int(context))] = seconds
    shape = DecodeShape(4, 2, 64, torch.bfloat16, 16, False, False)
    return choose_table(shape, timings, {"cuda": True, "triton": True})


def test_made_up_timings_choose_each_step_s_kernel_graphs_by_batch(
    report: dict[str, Any],
) -> None:
    result = finished_run(report, "made_up")
    assert result["measured"] == ["cuda,triton"]  # both kernels were handed to the timing
    assert_launches_follow_choices(result)
    table = made_up_table(report)
    for choice in result["choices"]:
        if choice["graphed"]:
            expected = table.graph_kernel_for(choice["batch"])
        else:
            expected = table.kernel_for(choice["batch"], choice["context"])
        assert choice["kernel"] == expected, choice
    # Graph sizes 1 and 2 read batch bucket 1 (CUDA's); 4 (a tie between 1 and 16 goes up)
    # and 8 read bucket 16, whose long contexts give its graphs to Triton.
    captured = {c["batch"]: c["kernel"] for c in result["choices"] if c["graphed"]}
    assert captured == {1: "cuda", 2: "cuda", 4: "triton", 8: "triton"}
    assert_graphs_captured_and_replayed(report, "made_up")
    # Replays run captured sizes only, Triton's graphs among them (the rig's steps of 3-5
    # decodes pad to 4 or 8).
    assert set(result["replayed"]) <= set(captured)
    assert "triton" in {captured[size] for size in result["replayed"]}
    # Eager steps read short contexts (bucket 128), where the made-up CUDA kernel wins.
    assert {c["kernel"] for c in result["choices"] if not c["graphed"]} == {"cuda"}
    assert result["tables"] == [table.describe()]


def test_made_up_timings_without_graphs_follow_the_cells(report: dict[str, Any]) -> None:
    result = finished_run(report, "made_up_eager")
    assert_launches_follow_choices(result)
    assert not any(c["graphed"] for c in result["choices"])
    assert report["made_up_eager"]["runtime"]["graph_captures"] == 0
    table = made_up_table(report)
    for choice in result["choices"]:
        assert choice["kernel"] == table.kernel_for(choice["batch"], choice["context"])
    # Without graphs, steps of up to 5 decodes ran; those of 4 or more read batch bucket 16.
    assert max(c["batch"] for c in result["choices"]) >= 4


def test_nothing_is_timed_on_the_rig_unless_a_test_injects_timings(
    report: dict[str, Any],
) -> None:
    result = finished_run(report, "unmeasured")
    assert_launches_follow_choices(result)
    assert {c["kernel"] for c in result["choices"]} == {"cuda"}
    assert result["tables"] == [
        "decode attention (4/2 heads x 64 bfloat16, block 16): unmeasured (no CUDA device to "
        "time on), cuda for every step"
    ]
    assert_graphs_captured_and_replayed(report, "unmeasured")


def test_an_unknown_pin_is_refused_at_load_naming_the_variable(report: dict[str, Any]) -> None:
    refused = report["bad_pin"]["result"]["refused"]
    assert refused == "KVRELAY_DECODE_ATTENTION='fastest': use one of auto, cuda, triton"
