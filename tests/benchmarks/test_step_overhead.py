"""benchmarks/step_overhead.py: its two measurements on real parts (the embedded model offline,
the session's server over HTTP), its table, and its refusal of an unknown serving mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.scripts import load_script
from tests.servers import ServerProcess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "step_overhead.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script(SCRIPT)


def test_help_names_the_options() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    flags = ("--dtypes", "--modes", "--tokens", "--repeats", "--model", "--quantization",
             "--int8-activations")  # fmt: skip
    for flag in flags:
        assert flag in out.stdout


def test_unknown_mode_is_refused(script: ModuleType) -> None:
    with pytest.raises(SystemExit):
        script.parse_args(["--modes", "colocated,sideways"])
    assert script.parse_args(["--modes", "colocated"]).modes == ["colocated"]


def test_quantization_names_the_rows_and_is_checked(script: ModuleType) -> None:
    assert script.parse_args([]).quantization == "none"
    assert script.weights_label("float32", "none") == "float32"
    assert script.weights_label("bfloat16", "q4_1") == "bfloat16, q4_1"
    assert script.weights_label("bfloat16", "q4_1", True) == "bfloat16, q4_1, int8"
    assert script.parse_args(["--quantization", "q4_1", "--int8-activations"]).int8_activations
    with pytest.raises(SystemExit):
        script.parse_args(["--quantization", "q2_k"])


def test_table_reports_overhead_and_ratio(script: ModuleType) -> None:
    # The ratio is the median of the paired runs' ratios, not the ratio of the medians.
    text = script.table([script.Row("float32", 2, 20.0, "colocated", 25.0, 1.2)])
    assert "| float32 | 2 | 20.0 | colocated | 25.0 | +5.0 | 1.20x |" in text


def test_a_row_pairs_an_offline_engine_with_the_workers_thread_count(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Disaggregated, the cores are split between the prefill and the decode worker: the
    # offline step it is set against must not run on twice the threads.
    monkeypatch.setattr(script.os, "cpu_count", lambda: 8)
    assert script.worker_threads("colocated") == 8
    assert script.worker_threads("disaggregated") == 4
    monkeypatch.setattr(script.os, "cpu_count", lambda: 1)
    assert script.worker_threads("disaggregated") == 1


def test_offline_streams_run_one_after_another_on_one_engine(script: ModuleType) -> None:
    """The offline step is timed on the embedded model; the paired runs reuse one engine,
    each stream finishing and freeing its blocks."""
    stream = script.OfflineStream(None, "float32", tokens=4, threads=1)
    engine = stream.llm.engine
    assert engine.config.num_threads == 1
    free = engine.kv_cache.num_free_blocks
    steps = [stream.step_ms() for _ in range(2)]
    assert all(0.1 < ms < 10_000 for ms in steps)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == free
    stream.close()


@pytest.mark.parametrize("int8", [False, True])
def test_an_offline_stream_runs_the_quantized_weights(script: ModuleType, int8: bool) -> None:
    from kvrelay.models.quantized import Int4Linear

    stream = script.OfflineStream(None, "float32", tokens=3, quantization="q4_1",
                                  int8_activations=int8)  # fmt: skip
    model = stream.llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert layers and all((m.int8_ops is not None) == int8 for m in layers)
    assert 0.1 < stream.step_ms() < 10_000
    stream.close()


@pytest.mark.e2e
def test_served_tpot_comes_from_a_real_stream(
    script: ModuleType, kvrelay_server: ServerProcess
) -> None:
    tpot_ms = script.served_tpot_ms(kvrelay_server.http_url, 6)
    assert 0.1 < tpot_ms < 10_000


@pytest.mark.e2e
def test_a_refused_stream_says_what_the_server_answered(
    script: ModuleType, kvrelay_server: ServerProcess
) -> None:
    with pytest.raises(RuntimeError, match="the server answered 400"):
        script.served_tpot_ms(kvrelay_server.http_url, 10**9)  # beyond any context
