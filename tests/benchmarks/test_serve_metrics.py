"""benchmarks/serve.py's maths on hand-computed request records, so the numbers cannot rot."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.serving.arrivals import send_offsets
from benchmarks.serving.dataset import length_bounds, random_requests
from benchmarks.serving.metrics import Summary, calculate_metrics, parse_goodput
from benchmarks.serving.records import RequestRecord
from benchmarks.serving.report import format_table, result_dict
from benchmarks.serving.runner import RunResult, RunSettings

REPO = Path(__file__).resolve().parents[2]


def records() -> list[RequestRecord]:
    # r1: 4 tokens by usage; r2: 1 token, no usage (counted from chunks); r3: 2 tokens by
    # chunks; r4 failed. Times in seconds.
    return [
        RequestRecord(
            prompt_len=10,
            success=True,
            start_time=0.0,
            ttft=0.1,
            itl=[0.05, 0.05, 0.1],
            latency=0.3,
            output_tokens=4,
            token_chunks=4,
        ),
        RequestRecord(
            prompt_len=20, success=True, start_time=0.2, ttft=0.3, latency=0.3, token_chunks=1
        ),
        RequestRecord(
            prompt_len=30,
            success=True,
            start_time=1.0,
            ttft=0.2,
            itl=[0.2],
            latency=0.4,
            token_chunks=2,
        ),
        RequestRecord(prompt_len=40, success=False, error="HTTP 500"),
    ]


def test_totals_and_throughputs() -> None:
    m = calculate_metrics(records(), duration=2.0, percentiles=[99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 60  # failed requests' prompts do not count
    assert m.output_lens == (4, 1, 2, 0)
    assert m.total_output == 7
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)


def test_latency_summaries() -> None:
    m = calculate_metrics(records(), duration=2.0, percentiles=[50, 90, 99])
    # TTFT 100, 300, 200 ms.
    assert m.ttft.mean == pytest.approx(200.0) and m.ttft.median == pytest.approx(200.0)
    assert m.ttft.std == pytest.approx(math.sqrt(20000 / 3))  # population std, as numpy's
    # Linear interpolation between order statistics: p90 of [100, 200, 300] is 280.
    assert dict(m.ttft.percentiles) == pytest.approx({50: 200.0, 90: 280.0, 99: 298.0})
    # TPOT = (e2e - ttft) / (tokens - 1): r1 200/3 ms, r3 200 ms; r2 (1 token) is left out.
    assert m.tpot.mean == pytest.approx((200 / 3 + 200) / 2)
    assert m.tpot.median == pytest.approx((200 / 3 + 200) / 2)
    # ITL pools every gap of every request: 50, 50, 100, 200.
    assert m.itl.mean == pytest.approx(100.0) and m.itl.median == pytest.approx(75.0)
    assert m.e2el.mean == pytest.approx(1000 / 3) and m.e2el.median == pytest.approx(300.0)


def test_goodput() -> None:
    def goodput(slos: list[str]) -> float:
        return calculate_metrics(records(), 2.0, [99], parse_goodput(slos)).request_goodput

    # Only r1 meets both (r2's TTFT 300 > 250, r3's TPOT 200 > 100).
    assert goodput(["ttft:250", "tpot:100"]) == pytest.approx(0.5)
    # SLOs are inclusive: r1 and r2 end exactly at 300 ms.
    assert goodput(["e2el:300"]) == pytest.approx(1.0)
    # A one-token request's TPOT counts as 0 for goodput.
    assert goodput(["tpot:0"]) == pytest.approx(0.5)
    assert calculate_metrics(records(), 2.0, [99]).request_goodput == 0.0


def test_peaks() -> None:
    m = calculate_metrics(records(), 2.0, [99])
    # r1 [0, 0.3) and r2 [0.2, 0.5) overlap; r3 starts later.
    assert m.max_concurrent_requests == 2
    # Tokens land at 0.1, 0.15, 0.2, 0.3 (r1), 0.5 (r2) in second 0; 1.2, 1.4 (r3) in second 1.
    assert m.max_output_tokens_per_s == 5.0


def test_back_to_back_requests_do_not_overlap() -> None:
    a = RequestRecord(
        prompt_len=1, success=True, start_time=0.0, ttft=0.5, latency=1.0, token_chunks=1
    )
    b = RequestRecord(
        prompt_len=1, success=True, start_time=1.0, ttft=0.5, latency=1.0, token_chunks=1
    )
    assert calculate_metrics([a, b], 2.0, [99]).max_concurrent_requests == 1


def test_output_length_fallbacks() -> None:
    by_usage = RequestRecord(prompt_len=1, output_tokens=9, token_chunks=7, max_tokens=16)
    assert by_usage.output_len == 9
    # No usage, but it stopped for length: it made exactly max_tokens, whatever the chunks.
    by_length = RequestRecord(prompt_len=1, token_chunks=12, max_tokens=16, finish_reason="length")
    assert by_length.output_len == 16
    by_chunks = RequestRecord(prompt_len=1, token_chunks=12, max_tokens=16, finish_reason="stop")
    assert by_chunks.output_len == 12


def test_empty_metrics_are_zero_not_nan() -> None:
    m = calculate_metrics(
        [RequestRecord(prompt_len=5, success=True, ttft=0.1, latency=0.1, token_chunks=1)],
        1.0,
        [50, 99],
    )
    assert m.tpot == Summary(0.0, 0.0, 0.0, ((50, 0.0), (99, 0.0)))
    assert m.itl.mean == 0.0
    failed = calculate_metrics([RequestRecord(prompt_len=5)], 1.0, [99])
    assert failed.completed == 0 and failed.ttft.mean == 0.0 and failed.max_concurrent_requests == 0


@pytest.mark.parametrize("bad", ["ttft", "ttft:x", "latency:5", "tpot:-1"])
def test_goodput_parsing_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_goodput_parsing() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 0.0,
    }


def test_arrivals() -> None:
    assert send_offsets(4, float("inf"), 1.0, seed=0) == [0.0] * 4
    poisson = send_offsets(50, 10.0, 1.0, seed=3)
    assert poisson == send_offsets(50, 10.0, 1.0, seed=3)  # seeded
    assert poisson != send_offsets(50, 10.0, 1.0, seed=4)
    assert poisson[-1] == pytest.approx(5.0)  # rescaled: n requests span n / rate seconds
    assert all(b >= a for a, b in itertools.pairwise(poisson))
    even = send_offsets(4, 2.0, float("inf"), seed=0)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    bursty = send_offsets(50, 10.0, 0.2, seed=3)
    bursty_gaps = [b - a for a, b in itertools.pairwise(bursty)]
    # Lower burstiness: the same mean gap, spread wider.
    assert max(bursty_gaps) > max(gaps)
    with pytest.raises(ValueError, match="burstiness"):
        send_offsets(3, 1.0, 0.0, seed=0)


class CharTokenizer:
    """One token per character of a 40-letter alphabet; id 0 is special."""

    all_special_ids = (0,)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLM"

    def __len__(self) -> int:
        return len(self.alphabet) + 1

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - 1] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.alphabet.index(c) + 1 for c in text]


def test_random_dataset_lengths_and_seed() -> None:
    assert length_bounds(100, 0.0) == (100, 100)
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(1, 0.5) == (1, 2)
    with pytest.raises(ValueError):
        length_bounds(10, 1.0)
    reqs = random_requests(CharTokenizer(), 20, 30, 8, 0.5, seed=1)
    assert reqs == random_requests(CharTokenizer(), 20, 30, 8, 0.5, seed=1)
    assert all(15 <= r.prompt_len <= 45 and 4 <= r.output_len <= 12 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1  # the ratio actually varies lengths
    fixed = random_requests(CharTokenizer(), 5, 30, 8, 0.0, seed=1)
    assert all(r.prompt_len == 30 and r.output_len == 8 for r in fixed)


def test_table_and_json_use_vllm_labels_and_keys() -> None:
    run = RunResult(records=records(), duration=2.0)
    m = calculate_metrics(run.records, run.duration, [50, 99], parse_goodput(["e2el:300"]))
    table = format_table(
        m,
        run,
        RunSettings(max_concurrency=16),
        goodput=True,
        selected=("ttft", "tpot", "itl", "e2el"),
    )
    for label in (
        "Successful requests:",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Maximum request concurrency:",
    ):
        assert label in table
    assert "Output token throughput (tok/s):         3.50" in table
    result = result_dict(m, run, goodput=True, extra={})
    assert result["request_goodput"] == pytest.approx(1.0)
    assert result["p50_ttft_ms"] == pytest.approx(200.0)
    assert result["output_lens"] == [4, 1, 2, 0] and result["errors"][3] == "HTTP 500"


def test_serve_help_works() -> None:
    for script in ("serve.py", "serve_compare.py"):
        out = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / script), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "--max-concurrency" in out.stdout
