"""gpu_check part 3's own arithmetic, on the CPU with fakes: kernels per decoder layer from a
profiler's events at two depths, the device's busy time, exact greedy comparison up to an
EOS, the throughput peers (transformers' generate_batch missing, failing or timed by its
requests' lifespans), the step rows' targets and the JIT-compiles-after-ready row."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def parts() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(BENCH))
    from gpu_parts import (
        engine_exact,
        engine_models,
        engine_part,
        engine_steps,
        engine_throughput,
        profile_events,
    )

    yield {
        "events": profile_events,
        "exact": engine_exact,
        "models": engine_models,
        "part": engine_part,
        "steps": engine_steps,
        "throughput": engine_throughput,
    }


def fake_step(ev: ModuleType, layers: int, t0: float = 0.0) -> list[Any]:
    """One decode step's device events: 10 kernels per layer (gemm x4, rmsnorm x2, rope,
    paged_decode, silu_mul, add), 5 outside (embedding, final norm, lm_head, argmax x2),
    and copies / fills that are not kernels."""
    layer = ["gemm", "gemm", "rmsnorm", "rope", "paged_decode", "gemm", "add", "rmsnorm"]
    layer += ["gemm", "silu_mul"]
    names = ["Memcpy HtoD (Pinned -> Device)", "embedding"]
    names += layer * layers + ["rmsnorm", "gemm", "argmax", "argmax", "Memset (Device)"]
    return [ev.DeviceEvent(n, t0 + i, t0 + i + 0.5) for i, n in enumerate(names)]


def test_kernels_per_layer_by_differencing_two_depths(parts: dict[str, ModuleType]) -> None:
    ev = parts["events"]
    deep, shallow = ev.kernel_counts(fake_step(ev, 30)), ev.kernel_counts(fake_step(ev, 2))
    assert "Memcpy HtoD (Pinned -> Device)" not in deep and "Memset (Device)" not in deep
    layers = ev.per_layer(deep, 30, shallow, 2)
    assert layers.per_layer == pytest.approx(10.0)
    assert layers.outside == pytest.approx(5.0)
    assert layers.top[:2] == [("gemm", 4.0), ("rmsnorm", 2.0)]
    assert all(n not in dict(layers.top) for n in ("argmax", "embedding"))
    # Counts per step over 2 profiled steps (floats) give the same answer.
    halves = {n: c * 2 / 2 for n, c in deep.items()}
    assert ev.per_layer(halves, 30, shallow, 2).per_layer == pytest.approx(10.0)
    with pytest.raises(ValueError, match="two depths"):
        ev.per_layer(shallow, 2, deep, 30)


@pytest.mark.parametrize(("per_layer", "status"), [(10.0, "PASS"), (11.5, "MISS")])
def test_the_layers_row_target(parts: dict[str, ModuleType], per_layer: float, status: str) -> None:
    ev, steps = parts["events"], parts["steps"]
    name = "void at::native::(anonymous namespace)::rms_norm<float, 4>(int, float*)"
    layers = ev.LayerKernels(per_layer, 5.0, [(name, 3.0)])
    row = steps.layers_row("135M", layers, "CUDA kernels", cuda=True)
    assert row.status == status and row.target == "<= 10"
    assert row.note == "at::native::rms_norm<float, 4> x3"  # short name: no void, no (args)
    assert ev.short_name("x" * 60, 10) == "xxxxxxx..."
    cpu = steps.layers_row("135M", layers, "CPU ops", cuda=False)
    assert cpu.status == "SKIP" and "CPU ops" in cpu.value


def test_device_events_are_read_from_profiler_events(parts: dict[str, ModuleType]) -> None:
    """What a profiler's `events()` holds on a GPU: CPU ops, kernels, a copy, and a
    record_function range on the GPU's timeline, which is not device work of its own."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name: str, device: Any, start: float, **extra: Any) -> Any:
        span = SimpleNamespace(start=start, end=start + 2.0)
        return SimpleNamespace(name=name, device_type=device, time_range=span, **extra)

    ev = parts["events"]
    linear = event("aten::linear", DeviceType.CPU, 0.0, cpu_parent=None)
    events = [
        linear,
        event("aten::mm", DeviceType.CPU, 0.5, cpu_parent=linear),
        event("gemm", DeviceType.CUDA, 1.0, activity_type="kernel"),
        event("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 4.0),
        event("## step ##", DeviceType.CUDA, 0.0, is_user_annotation=True),
        event("range", DeviceType.CUDA, 0.0, activity_type="gpu_user_annotation"),
    ]
    device = ev.device_events(events)
    assert [e.name for e in device] == ["gemm", "Memcpy DtoD (Device -> Device)"]
    assert ev.busy_us(device) == 4.0 and ev.kernel_counts(device) == {"gemm": 1}
    assert ev.cpu_op_counts(events) == {"aten::linear": 1}  # aten::mm is linear's


def test_busy_time_counts_overlapping_work_once(parts: dict[str, ModuleType]) -> None:
    ev = parts["events"]
    events = [ev.DeviceEvent("a", 0, 10), ev.DeviceEvent("b", 5, 12), ev.DeviceEvent("c", 20, 25)]
    events.append(ev.DeviceEvent("d", 21, 22))  # inside c
    assert ev.busy_us(events) == pytest.approx(17.0)
    assert ev.busy_us([]) == 0.0


def test_step_rows_judge_wall_against_gpu_at_batch_16_and_up(
    parts: dict[str, ModuleType],
) -> None:
    steps = parts["steps"]
    row = steps.step_row
    t = steps.StepTime
    assert row("135M", "graphs", 1, t(0.5, 0.3), True).status == "PASS"
    slow = row("135M", "graphs", 1, t(0.7, 0.3), True)
    assert slow.status == "MISS" and slow.target == "<= 0.6 ms"
    assert row("1B", "graphs", 1, t(0.9, None), True).status == "PASS"
    ok = row("135M", "graphs", 16, t(1.05, 1.0), True)
    assert ok.status == "PASS" and ok.value == "wall 1.050 ms, GPU 1.000 ms = 1.05x"
    assert row("135M", "graphs", 256, t(1.2, 1.0), True).status == "MISS"
    assert row("135M", "graphs", 64, t(1.2, None), True).status == "SKIP"
    assert row("135M", "eager", 64, t(9.0, None), True).target == ""  # no target eager
    cpu = row("135M", "graphs", 16, t(9.0, None), False)
    assert cpu.status == "PASS" and "GPU" in cpu.note


def test_exact_comparison_stops_at_the_first_eos(parts: dict[str, ModuleType]) -> None:
    exact = parts["exact"]
    eos = {2}
    assert exact.first_parting([5, 2], [5, 2, 0, 0], eos) is None  # padded after EOS
    assert exact.first_parting([5, 7, 9], [5, 7, 9], eos) is None
    assert exact.first_parting([5, 7, 9], [5, 2], eos) == 1  # theirs ended at an EOS
    assert exact.first_parting([5, 2], [5, 7, 9], eos) == 1  # ours did
    assert exact.first_parting([5, 7], [5, 7, 9], eos) == 2  # ours stopped short


class FakeLM(torch.nn.Module):
    """A 'model' whose next-token logits are fixed: what logit_gap reads."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.logits = torch.tensor(logits)

    def forward(self, ids: torch.Tensor) -> Any:
        return type("Out", (), {"logits": self.logits.expand(1, ids.shape[1], -1)})()


def test_the_exact_row_fails_any_parting_and_says_the_gap(parts: dict[str, ModuleType]) -> None:
    exact = parts["exact"]
    hf, prompts = FakeLM([0.0, 1.0, 2.0, 3.0]), [[1, 1], [3]]
    same = exact.exact_row("x", hf, prompts, [[3, 2], [3, 3]], [[3, 2, 0], [3, 3]], {2})
    assert (same.status, same.value, same.note) == ("PASS", "2/2 equal", "1 ended at an EOS")
    parted = exact.exact_row("x", hf, prompts, [[3, 1], [3, 3]], [[3, 3], [3, 3]], {2})
    assert parted.status == "FAIL" and parted.value == "1/2 equal"
    assert "token 1 is 1, transformers 3" in parted.note and "logit gap 2.00e+00" in parted.note


def test_no_tf32_turns_tf32_off_and_restores_it(parts: dict[str, ModuleType]) -> None:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = True
        with pytest.raises(RuntimeError), parts["exact"].no_tf32():
            assert not matmul.allow_tf32 and not cudnn.allow_tf32
            raise RuntimeError("restored even so")
        assert matmul.allow_tf32 and cudnn.allow_tf32
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


@dataclass
class Output:
    generated_tokens: list[int]
    lifespan: tuple[float, float] = (-1, -1)
    error: str | None = None


class FakeBatcher:
    """A transformers model as generate_batch sees it."""

    def __init__(self, outputs: list[Output] | Exception) -> None:
        self.outputs = outputs
        self.calls: list[dict[str, Any]] = []

    def generate_batch(
        self, inputs: list[list[int]], generation_config: Any = None, progress_bar: bool = True
    ) -> dict[str, Output]:
        self.calls.append({"inputs": inputs, "config": generation_config, "bar": progress_bar})
        if isinstance(self.outputs, Exception):
            raise self.outputs
        return {f"req_{i}": o for i, o in enumerate(self.outputs)}


def test_generate_batch_missing_or_failing_is_that_peers_n_a(
    parts: dict[str, ModuleType],
) -> None:
    tp = parts["throughput"]
    missing = tp.generate_batch_rate(object(), [[1, 2]], 4, small=True)
    assert missing == "n/a: this transformers has no generate_batch"
    failing = tp.generate_batch_rate(FakeBatcher(RuntimeError("no paged cache")), [[1]], 4, True)
    assert failing == "n/a: generate_batch raised RuntimeError: no paged cache"
    errored = FakeBatcher([Output([3] * 4), Output([], error="OOM")])
    assert "(OOM)" in tp.generate_batch_rate(errored, [[1], [2]], 4, True)
    short = tp.generate_batch_rate(FakeBatcher([Output([3] * 4)]), [[1], [2]], 4, True)
    assert "1/2" in short and "1 requests missing" in short
    ours, static = tp.Rate(1000, 0.01), tp.Rate(1000, 1.0)
    rows = tp.rate_rows(True, "2 concurrent", ours, static, missing)
    assert [r.status for r in rows] == ["PASS", "SKIP", "PASS"]
    assert rows[1].note == missing and "generate_batch n/a" in rows[0].note


def test_generate_batch_is_timed_by_its_requests_lifespans(parts: dict[str, ModuleType]) -> None:
    tp = parts["throughput"]
    model = FakeBatcher([Output([3] * 4, (10.0, 12.0)), Output([4] * 4, (10.5, 14.0))])
    rate = tp.generate_batch_rate(model, [[1], [2]], 4, small=True)
    assert rate.tokens == 8 and rate.seconds == pytest.approx(4.0) and rate.tok_s == 2.0
    config = model.calls[0]["config"]
    assert config.max_new_tokens == 4 and config.do_sample is False
    assert model.calls[0]["bar"] is False  # the keyword it takes, and only those
    no_spans = tp.rate_of_results([Output([3] * 4)], 1, wall=2.0)
    assert no_spans.seconds == 2.0 and "no lifespans" in no_spans.note
    ours = tp.Rate(64_000, 1.0)
    rows = tp.rate_rows(True, "256 concurrent", ours, tp.Rate(6_000, 1.0), tp.Rate(4_000, 1.0))
    assert [r.status for r in rows] == ["PASS", "PASS", "PASS"]
    assert rows[1].value == "16.0x (64,000 vs 4,000 tok/s)"
    rows = tp.rate_rows(True, "256 concurrent", tp.Rate(50_000, 1.0), tp.Rate(9e3, 1.0),
                        tp.Rate(5e3, 1.0))  # fmt: skip
    assert [r.status for r in rows] == ["MISS", "MISS", "PASS"]


class Counters:
    """COUNTERS as an older checkout has them: no jit fields."""

    cuda_decode_calls = 3


def test_jit_compiles_after_ready(
    parts: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    part, models = parts["part"], parts["models"]
    now = {"jit_compiles": 12, "jit_compiles_after_ready": 0}
    assert part.jit_row(now, True, True).status == "PASS"
    late = part.jit_row({**now, "jit_compiles_after_ready": 2}, True, True)
    assert late.status == "FAIL" and late.value == "2 after ready (12 compiles in all)"
    assert part.jit_row({**now, "jit_compiles": 0}, True, True).status == "SKIP"
    assert "ready" in part.jit_row(now, True, False).note
    assert part.jit_row(now, False, None).status == "SKIP"
    from kvrelay_kernels import counters as module

    monkeypatch.setattr(module, "COUNTERS", Counters())
    older = models.counters()
    assert older == {"cuda_decode_calls": 3}
    row = part.jit_row(older, True, True)
    assert row.status == "SKIP" and "no jit_compiles_after_ready" in row.note


def test_models_draw_weights_at_the_gain_and_keep_part_4s_key(
    parts: dict[str, ModuleType],
) -> None:
    models = parts["models"]
    assert models.init_std(576) == pytest.approx(0.04)
    ctx = type("Ctx", (), {"cuda": True})()
    assert models.model_key(ctx, "m", None, None) == "model:m"
    assert models.model_key(ctx, "m", torch.bfloat16, None) == "model:m"
    assert models.model_key(ctx, "m", torch.float32, None) == "model:m:torch.float32:None"
    assert models.model_key(ctx, "m", None, 2) == "model:m:None:2"
