"""The engine's CUDA code paths on a CPU-only machine, with fake (shapes-only) CUDA tensors
(tests/fake_cuda): the `cuda` backend with the decode kernel and Triton splitting mixed steps,
CUDA graphs captured and replayed, pinned staging, the KV sizing from free device memory, the
KV fence and pinned transfers of a hand-off. Every step runs under issue 14's rules: no device
value read on the host besides the sampled ids, no blocking copy, no host tensor in a device
op, no index built implicitly on the host.

The meta-device tests (test_device.py) run the same steps on the torch backend; these take the
branches that only a CUDA device takes. The scenarios run in a process of their own, once
(tests/fake_cuda/scenarios.py); each test reads its part of the report."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrelay.engine.graph_padding import capture_sizes
from kvrelay.engine.memory_profile import MemoryProfile, kv_cache_budget
from kvrelay_kernels import cuda_backend
from tests.fake_cuda import runtime
from tests.fake_cuda.report import run_scenarios
from tests.fake_cuda.scenarios import BATCH_TOKENS, MAX_NUM_SEQS, PREEMPTION_TOKENS, SAMPLED

TOKENS = 6  # max_tokens of every scenario request
REQUESTS = {"short", "penalised", "long", "pair"}

pytestmark = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only torch (GPU tests cover it)"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenarios(
        "tests.fake_cuda.scenarios", tmp_path_factory.mktemp("fake-cuda") / "report.json"
    )


def result_of(report: dict[str, Any], name: str) -> dict[str, Any]:
    """A scenario's findings, after checking that it ran to the end within the rules."""
    part = report[name]
    assert "error" not in part, part["error"]
    assert part["violations"] == [], part["violations"]
    result: dict[str, Any] = part["result"]
    if "steps" in result:
        # The sampler's one launch (Triton's sample_rows, on steps with a non-greedy row)
        # follows the forward, graphed or not: the tests below are about the forward's kernels.
        samplers = [[c for c in s if c[0] == "sample_rows"] for s in result["steps"]]
        assert all(len(calls) <= 1 for calls in samplers), samplers
        result["steps"] = [[c for c in s if c[0] != "sample_rows"] for s in result["steps"]]
    return result


def kernels_of(step: list[list[Any]]) -> set[str]:
    return {name for name, _ in step}


def assert_every_request_finished(result: dict[str, Any], ids: set[str] = REQUESTS) -> None:
    assert result["aborted"] == []
    assert result["finished"] == {rid: [SAMPLED] * TOKENS for rid in ids}
    assert result["pool_whole"]


def test_the_rig_catches_each_mistake_a_step_must_not_make(report: dict[str, Any]) -> None:
    """If the rules did not bite, every other test here would pass for nothing."""
    caught = report["rules"]["result"]
    assert caught.pop("allowed_device") == "cuda:0"  # a non-blocking upload is fine
    # `device[[0, 2]]` copies its index up inside torch, where no fake tensor can be made:
    # the step fails there, which the tests below would see as a failed request.
    assert caught.pop("list_index") == "NotImplementedError"
    assert caught == {
        "item": "AssertionError",
        "tolist": "AssertionError",
        "blocking_upload": "AssertionError",
        "blocking_download": "AssertionError",
        "host_operand": "AssertionError",
        "tensor_on_device": "AssertionError",
    }
    assert len(report["rules"]["violations"]) == 6


def test_graphed_steps_split_mixed_batches_and_replay_pure_decodes(
    report: dict[str, Any],
) -> None:
    result = result_of(report, "graphs")
    assert result["backend"] == "cuda" and result["graphs"]
    assert_every_request_finished(result)
    counters, log = report["graphs"]["counters"], report["graphs"]["runtime"]
    # One graph per padded batch size, captured once at start-up under the strict rules.
    assert log["graph_captures"] == counters["graph_captures"] == len(capture_sizes(MAX_NUM_SEQS))
    steps = result["steps"]
    mixed = [s for s in steps if kernels_of(s) >= {"decode", "triton"}]
    assert mixed, "no step had decode rows beside a prefill chunk"
    for step in mixed:  # the two short requests decode while the long prompt is chunked
        assert {rows for name, rows in step if name == "decode"} == {2}
    # Once the long prompt is in, every step is a pure decode and replays a graph; the first
    # copies the pair's shared block (copy-on-write) eagerly, then replays.
    replayed = [s for s in steps if not s or kernels_of(s) == {"copy_blocks"}]
    assert [name for s in replayed for name, _ in s] == ["copy_blocks"]
    assert counters["graph_replays"] == log["graph_replays"] == len(replayed) > 0
    assert counters["eager_steps"] == len(steps) - len(replayed)


def test_eager_steps_run_the_decode_kernel_on_every_decode(report: dict[str, Any]) -> None:
    result = result_of(report, "eager")
    assert result["backend"] == "cuda" and not result["graphs"]
    assert_every_request_finished(result)
    assert report["eager"]["counters"]["graph_captures"] == 0
    decode_steps = [s for s in result["steps"] if "decode" in kernels_of(s)]
    assert len(decode_steps) == len(result["steps"]) - 1  # all but the first, the prefill
    assert all("triton" not in kernels_of(s) for s in result["steps"][-3:])
    copies = [s for s in result["steps"] if "copy_blocks" in kernels_of(s)]
    assert len(copies) == 1 and copies[0][0] == ["copy_blocks", 1]  # before the forward pass


def test_a_head_size_without_a_decode_kernel_runs_on_triton_alone(
    report: dict[str, Any],
) -> None:
    result = result_of(report, "no_decode_kernel")
    assert result["backend"] == "cuda" and not result["graphs"]  # nothing to capture
    assert_every_request_finished(result)
    # Attention on Triton alone; the layers' own ops are the fused ones (KV written by RoPE's).
    layer_ops = {"rms_norm", "add_rms_norm", "rope_and_write_kv", "silu_and_mul"}
    assert all(kernels_of(s) - {"copy_blocks"} == {"triton"} | layer_ops for s in result["steps"])
    assert report["no_decode_kernel"]["counters"]["cuda_decode_calls"] == 0


def test_preempted_requests_recompute_on_the_device_and_finish(report: dict[str, Any]) -> None:
    result = result_of(report, "preemption")
    assert result["preemptions"] > 0
    assert result["aborted"] == [] and result["pool_whole"]
    ids = {"long", "s0", "s1", "s2", "s3"}
    assert result["finished"] == {rid: [SAMPLED] * PREEMPTION_TOKENS for rid in ids}
    assert report["preemption"]["counters"]["graph_replays"] > 0


def test_the_gpu_checks_256_concurrent_requests_replay_graphs_up_to_256_rows(
    report: dict[str, Any],
) -> None:
    result = result_of(report, "gpu_check_batch")
    assert result["aborted"] == [] and result["pool_whole"]
    assert result["finished"] == {f"r{i}": [SAMPLED] * BATCH_TOKENS for i in range(256)}
    assert result["graph_sizes"] == capture_sizes(256) and capture_sizes(256)[-1] == 256
    counters = report["gpu_check_batch"]["counters"]
    assert counters["graph_captures"] == len(capture_sizes(256)) and counters["graph_replays"] > 0
    assert result["max_decode_rows"] > 128  # mixed steps' decode rows, beside prefill chunks


def test_long_contexts_split_k_within_the_graphs_workspace(report: dict[str, Any]) -> None:
    """Contexts up to 4160 tokens: each graph fixes its split-K count for the longest context
    (9 partitions of 512) and shares one workspace; the stand-in kernel checks that both
    cover every launch. (Eager decodes let the kernel choose: see the other scenarios.)"""
    result = result_of(report, "long_context")
    assert result["aborted"] == [] and result["pool_whole"]
    assert set(result["finished"]) == {"long", "short"}
    assert report["long_context"]["counters"]["graph_replays"] > 0
    parts = cuda_backend.max_partitions(4160)
    # [1, False]: the warm-up's eager decodes of short contexts, before the graphs.
    assert parts == 9 and report["long_context"]["decode_splits"] == [[1, False], [parts, True]]
    assert [1, False] in report["eager"]["decode_splits"]  # short contexts, no workspace


def test_every_step_uploads_through_pinned_staging(report: dict[str, Any]) -> None:
    result = result_of(report, "graphs")
    log = report["graphs"]["runtime"]
    assert result["uploads"] >= len(result["steps"])
    # The stager records an event after each upload and waits on it before refilling.
    assert log["events_recorded"] == len(result["steps"])
    assert log["events_waited"] == len(result["steps"]) - 1


def test_the_kv_cache_is_sized_from_free_device_memory(report: dict[str, Any]) -> None:
    result = result_of(report, "memory_profile")
    assert result["kv_device"] == "cuda:0"
    profile = MemoryProfile(
        total=runtime.TOTAL_MEMORY,
        used_before=runtime.TOTAL_MEMORY - runtime.FREE_MEMORY,
        peak_increase=runtime.PEAK_ALLOCATION,
    )
    workspace = 4 * cuda_backend.split_workspace_numel(
        MAX_NUM_SEQS, 4, 64, cuda_backend.max_partitions(1024)
    )
    budget = kv_cache_budget(profile, 0.5, reserved=workspace)
    assert result["num_blocks"] == budget // result["block_bytes"]
    # 0.5 x 141 GiB - 21 GiB in use - 256 MiB peak: ~49 GiB of bf16 blocks of 16 tokens.
    assert result["block_bytes"] == 2 * 2 * 16 * 2 * 64 * 2  # layers, K/V, tokens, heads, dim
    assert 49 * runtime.GIB < result["num_blocks"] * result["block_bytes"] < 50 * runtime.GIB


def test_a_handoff_fences_the_prefill_writes_and_moves_blocks_through_pinned_memory(
    report: dict[str, Any],
) -> None:
    result = result_of(report, "handoff")
    assert result["fence_waits"] == 1  # the handle left only after the KV writes completed
    assert result["bytes_moved"] == 4 * 16384  # 57 prompt tokens: 4 blocks of 16
    assert result["pinned_allocations"] > 0
    decoded = result["decoded"]
    assert decoded["aborted"] == [] and decoded["finished"] == {"r": [SAMPLED] * TOKENS}
    assert decoded["pool_whole"] and result["prefill_pool_whole"]


def test_a_direct_call_without_a_plan_gathers_on_the_query_device(report: dict[str, Any]) -> None:
    """The GPU check's kernel part failed here: the plan it built for itself kept its index
    tensors on the host, and the first split step with scattered decodes raised."""
    result = result_of(report, "direct_call")
    assert result["out"] == ["cuda:0", [5, 4, 64]]
    # The prefill is one contiguous span: Triton reads the whole query at its offsets.
    assert sorted(map(tuple, result["calls"])) == [("decode", 2), ("triton", 5)]


def test_the_engine_launches_each_step_kind_before_it_is_ready(report: dict[str, Any]) -> None:
    """The warm-up (engine/warm_up.py) on a 2-layer model, before any request: a prefill
    alone (Triton), a mixed step (the decode kernel and Triton, each on its rows), decodes
    alone, each with the Triton sampler on its logits; so every kernel variant is compiled
    before serving, not in its first steps."""
    calls = [tuple(call) for call in result_of(report, "warm_up")["calls"]]
    attention = {3: [("triton", 3)], 5: [("decode", 1), ("triton", 5)], 2: [("decode", 2)]}
    expected = []
    for rows, kernels_of_kind in attention.items():
        for first_norm in ("rms_norm", "add_rms_norm"):  # layer 0 has no pending MLP output
            expected += [(first_norm, rows), ("rope_and_write_kv", rows), *kernels_of_kind]
            expected += [("add_rms_norm", rows), ("silu_and_mul", rows)]
        expected.append(("add_rms_norm", rows))  # the final norm adds the last MLP output
        expected.append(("sample_rows", 1))  # the device sampler on the step's logits
    assert calls == expected
