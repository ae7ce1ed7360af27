"""`kvrelay serve`'s small-machine hint: when it is printed, what it says for each measured
outcome, and that a real P/D `kvrelay serve` on a machine of at most 4 cores prints it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrelay.serve_hint import (
    MEASURED,
    SMALL_MACHINE_CORES,
    ModeMeasurement,
    sharing_line,
    small_machine_hint,
)

COLOCATED_WINS = ModeMeasurement("bf16 on CPU X, 2026-01-01", {1: 1.5, 4: 1.25, 16: 1.1}, 0.5, 6.0)
PD_WINS = ModeMeasurement("bf16 on CPU Y, 2026-01-02", {1: 0.8, 4: 0.5, 16: 0.25}, 2.0, 8.0)


def test_no_hint_on_a_larger_machine_or_an_unknown_one() -> None:
    for colocated in (False, True):
        assert small_machine_hint(SMALL_MACHINE_CORES + 1, colocated) is None
        assert small_machine_hint(64, colocated) is None
        assert small_machine_hint(None, colocated) is None
    assert small_machine_hint(SMALL_MACHINE_CORES, False) is not None
    assert small_machine_hint(1, False) is not None


def test_p_d_on_a_small_machine_is_told_colocated_serves_faster() -> None:
    line = small_machine_hint(2, colocated=False, measured=COLOCATED_WINS)
    assert line == (
        "kvrelay: hint: 2 cores: --colocated serves faster here; --colocated served "
        "1.10-1.50x P/D's output tok/s at 1/4/16 streams; colocated's TTFT p50 at 1 stream "
        "was 0.50x P/D's, its ITL p99 6.0x P/D's (bf16 on CPU X, 2026-01-01); see "
        "docs/benchmarks.md, 'P/D or colocated on a small machine'"
    )
    assert "\n" not in line  # one line


def test_colocated_on_a_small_machine_is_confirmed() -> None:
    line = small_machine_hint(4, colocated=True, measured=COLOCATED_WINS)
    assert line is not None and line.startswith("kvrelay: hint: 4 cores: colocated is the pick")


def test_where_p_d_measured_faster_the_hint_says_so() -> None:
    pd_line = small_machine_hint(2, colocated=False, measured=PD_WINS)
    assert pd_line is not None
    assert "P/D (the default) is the pick here" in pd_line
    # P/D over colocated: 1/0.8 .. 1/0.25.
    assert "P/D served 1.25-4.00x colocated's output tok/s at 1/4/16 streams" in pd_line
    assert "; colocated's TTFT p50 at 1 stream was 2.00x P/D's, its ITL p99 8.0x P/D's" in pd_line
    assert "(bf16 on CPU Y, 2026-01-02)" in pd_line
    coloc_line = small_machine_hint(2, colocated=True, measured=PD_WINS)
    assert coloc_line is not None and "drop --colocated" in coloc_line


def test_a_mixed_outcome_does_not_call_colocated_the_pick() -> None:
    """Colocated ahead at one stream but behind at sixteen: not 'serves faster'."""
    mixed = ModeMeasurement("bf16 on Z, 2026-01-03", {1: 1.2, 16: 0.9}, 0.8, 5.0)
    assert not mixed.colocated_wins()
    line = small_machine_hint(2, colocated=False, measured=mixed)
    assert line is not None and "serves faster" not in line
    assert "0.83-1.11x" in line  # P/D over colocated, both ways of it


def test_a_mixed_outcome_names_where_each_mode_leads() -> None:
    """P/D ahead at 1 stream, colocated at 4 and 16: each mode's user is told what the other
    one gives, in the order of what they chose."""
    mixed = ModeMeasurement("bf16 on Z, 2026-01-03", {1: 0.9, 4: 1.2, 16: 1.3}, 1.1, 5.0)
    pd_line = small_machine_hint(2, colocated=False, measured=mixed)
    assert pd_line is not None and pd_line.startswith(
        "kvrelay: hint: 2 cores: P/D (the default) is the pick for latency, --colocated for "
        "throughput at 4/16 streams; P/D served 0.77-1.11x colocated's"
    )
    coloc_line = small_machine_hint(2, colocated=True, measured=mixed)
    assert coloc_line is not None and coloc_line.startswith(
        "kvrelay: hint: 2 cores: colocated is the pick for throughput at 4/16 streams, P/D "
        "(drop --colocated) for latency; "
    )
    assert mixed.colocated_ahead_at() == [4, 16] and PD_WINS.colocated_ahead_at() == []


def test_one_ratio_for_every_stream_count_is_written_once() -> None:
    same = ModeMeasurement("w", {1: 1.2, 4: 1.2}, 0.9, 2.0)
    line = small_machine_hint(2, colocated=False, measured=same)
    assert line is not None and "served 1.20x P/D's output tok/s at 1/4 streams" in line


def test_the_shipped_measurement_names_its_cpu_and_date() -> None:
    assert "2026-12-05" in MEASURED.where and "EPYC" in MEASURED.where
    assert sorted(MEASURED.tok_s) == [1, 4, 16]
    assert all(r > 0 for r in MEASURED.tok_s.values())
    # What `make serve` (P/D) prints on this project's 2-core machines, as measured.
    line = small_machine_hint(2, colocated=False)
    assert line is not None and line.startswith(
        "kvrelay: hint: 2 cores: P/D (the default) is the pick for latency, --colocated for "
        "throughput at 4/16 streams; "
    )
    assert "P/D served 0.83-1.07x colocated's output tok/s at 1/4/16 streams" in line
    assert "TTFT p50 at 1 stream was 1.10x P/D's, its ITL p99 5.9x P/D's" in line


@pytest.mark.slow
@pytest.mark.e2e
def test_kvrelay_serve_prints_the_hint_at_start(tmp_path: Path) -> None:
    """The real `kvrelay serve` (P/D, the default `make serve` runs): the hint is in its
    output before it is ready, on a machine of at most SMALL_MACHINE_CORES cores only."""
    from tests.servers import start_server

    server = start_server(tmp_path)
    try:
        log = server.log()
    finally:
        server.stop()
    expected = small_machine_hint(os.cpu_count(), colocated=False)
    if expected is None:
        assert "kvrelay: hint:" not in log
    else:
        assert expected in log.splitlines()


def test_shared_cores_add_a_line_saying_how_to_turn_them_off() -> None:
    line = sharing_line(2, 1)
    assert "all 2 cores" in line and "on its 1" in line and "KVRELAY_CORE_SHARE=off" in line
    both = small_machine_hint(2, colocated=False, shared_threads=1, measured=PD_WINS)
    pick = small_machine_hint(2, colocated=False, measured=PD_WINS)
    assert both is not None and pick is not None and both == pick + "\n" + line
    # KVRELAY_CORE_SHARE=on on a larger machine: no measured pick, the sharing still said.
    assert small_machine_hint(8, colocated=False, shared_threads=4) == sharing_line(8, 4)
    assert small_machine_hint(None, colocated=False, shared_threads=1) is None
