"""benchmarks/tenant_fairness.py's own logic: the issue's targets from the victim's time alone,
the verdicts (a refused hog meets them, whatever the victim's times), the SSE parsing and the
tenants file it starts the server with (which the server's own parser accepts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.router.tenant_limits import load_table
from tests.benchmarks.scripts import load_script

bench = load_script(Path(__file__).parents[2] / "benchmarks" / "tenant_fairness.py")
Row, Timing = bench.Row, bench.Timing


def test_targets_follow_the_issue() -> None:
    fast = Row("x", Timing(0.3, 1.0), Timing(0.08, 1.4), "admitted")
    assert fast.ttft_target_s == 0.5  # max(0.5, 3 x 0.08)
    assert fast.total_target_s == pytest.approx(2.8)
    assert fast.verdict == "met"
    slow_start = Row("x", Timing(4.9, 2.0), Timing(0.2, 1.4), "admitted")
    assert slow_start.ttft_target_s == pytest.approx(0.6) and slow_start.verdict == "missed"
    slow_end = Row("x", Timing(0.1, 15.0), Timing(0.08, 1.4), "admitted")
    assert slow_end.verdict == "missed"
    refused = Row("x", Timing(9.0, 99.0), Timing(0.08, 1.4), "refused 400, param 'n': ...")
    assert refused.verdict == "met (hog refused)"


def test_the_table_has_a_row_per_scenario() -> None:
    rows = [
        Row("alone", Timing(0.08, 1.4), Timing(0.08, 1.4), "-"),
        Row("n = 128", Timing(0.1, 1.5), Timing(0.08, 1.4), "refused 400, param 'n': lower n"),
    ]
    table = bench.markdown(rows)
    assert table.count("\n") == 3
    assert "| n = 128 | 0.10 | 0.50 | 1.50 | 2.80 | met (hog refused) |" in table


def test_sse_events_stop_at_done() -> None:
    lines = ['data: {"choices": []}', "", ": comment", "data: [DONE]", 'data: {"late": 1}']
    assert bench.sse_text_events(lines) == [{"choices": []}]


def test_the_tenants_file_is_one_the_server_accepts(tmp_path: Path) -> None:
    table = load_table(str(bench.tenants_file(tmp_path)))
    assert table.keys == {key: name for name, key in bench.KEYS.items()}
    assert table.limits("burst").max_concurrent_sequences is None
    limited = load_table(str(bench.tenants_file(tmp_path, burst_limit=8)))
    assert limited.limits("burst").max_concurrent_sequences == 8
    assert limited.limits("victim").max_concurrent_sequences is None


def test_its_flags() -> None:
    args = bench.parse_args(["--burst", "4", "--max-in-flight", "8"])
    assert (args.burst, args.max_in_flight, args.victim_tokens, args.repeats) == (4, 8, 50, 3)
