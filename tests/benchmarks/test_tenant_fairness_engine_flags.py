"""benchmarks/tenant_fairness.py's flags for the engine-bound scenario: the engine's batch
size and any other argument reach `kvrelay serve`, and `--only` picks the scenario."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

bench = load_script(Path(__file__).parents[2] / "benchmarks" / "tenant_fairness.py")


def test_the_engine_batch_and_extra_arguments_reach_kvrelay_serve(tmp_path: Path) -> None:
    limits = tmp_path / "tenants.json"
    args = bench.parse_args(
        ["--max-num-seqs", "8", "--serve-arg=--max-num-batched-tokens", "--serve-arg=256"]
    )
    assert bench.serve_args(args, limits) == (
        "--tenant-limits", str(limits), "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256",
    )  # fmt: skip
    defaults = bench.serve_args(bench.parse_args([]), limits)
    assert defaults == ("--tenant-limits", str(limits))  # serve's own defaults otherwise
    both = bench.parse_args(["--max-in-flight", "256", "--max-num-seqs", "4"])
    assert bench.serve_args(both, limits)[2:] == ("--max-in-flight", "256", "--max-num-seqs", "4")


def test_only_picks_one_scenario_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.parse_args(["--only", "burst"]).only == "burst"
    assert bench.parse_args([]).only is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "everything"])
    assert "invalid choice: 'everything'" in capsys.readouterr().err
