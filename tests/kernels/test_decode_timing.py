"""The decode dispatch's load-time step (kvrelay_kernels/decode_timing.py) on the CPU: the
timing loop with a made-up clock and timer (largest cells first, the budget, medians, a kernel
that raises), the inputs it builds, and `prepare`'s pins, refusals and injected timings.
Timing on a real device is gpu_check's (part 2) and the GPU tests'."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvrelay_kernels import decode_dispatch, decode_timing
from kvrelay_kernels.decode_dispatch import BATCH_BUCKETS, CONTEXT_BUCKETS, CUDA, TRITON
from kvrelay_kernels.env import DECODE_ATTENTION

ALL_CELLS = {(b, c) for b in BATCH_BUCKETS for c in CONTEXT_BUCKETS}


@pytest.fixture(autouse=True)
def no_tables() -> Iterator[None]:
    decode_dispatch.clear()
    yield
    decode_dispatch.clear()


def cache(blocks: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(blocks, 2, 2, 16, 2, 64, dtype=dtype)


SHAPE = decode_dispatch.shape_of(cache(), 4, False, False)


class Kernels:
    """Made-up decode calls that remember the last cell each ran, and a timer that answers
    from `cost` (seconds per call: kernel, batch, context)."""

    def __init__(self, cost: Callable[[str, int, int], float]) -> None:
        self.cost = cost
        self.last: tuple[str, int, int] | None = None
        self.samples: list[tuple[str, int, int, int]] = []  # (kernel, batch, context, calls)
        self.fail: set[str] = set()

    def call(self, name: str) -> decode_timing.DecodeCall:
        def run(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, context: int,
                out: torch.Tensor) -> None:  # fmt: skip
            if name in self.fail:
                raise RuntimeError(f"{name} cannot run this")
            assert q.shape == (tables.shape[0], 4, 64) and out.shape == q.shape
            assert lens.tolist() == [context] * q.shape[0]
            self.last = (name, q.shape[0], context)

        return run

    def timer(self, fn: Callable[[], object], calls: int) -> float:
        fn()
        assert self.last is not None
        self.samples.append((*self.last, calls))
        return self.cost(*self.last) * calls


def test_every_cell_is_timed_for_both_kernels_median_of_the_samples() -> None:
    k = Kernels(lambda name, b, c: (1e-6 if name == CUDA else 2e-6) * b * c / 128)
    calls = {CUDA: k.call(CUDA), TRITON: k.call(TRITON)}
    timings = decode_timing.measure(SHAPE, calls, cache(), timer=k.timer)
    assert set(timings) == {(n, b, c) for n in (CUDA, TRITON) for b, c in ALL_CELLS}
    assert timings[(CUDA, 64, 2048)] == pytest.approx(1e-6 * 64 * 2048 / 128)
    assert timings[(TRITON, 1, 128)] == pytest.approx(2e-6)
    # Per cell and kernel: a probe of one call, then REPEATS samples of enough calls to last
    # SAMPLE_S (at most MAX_CALLS), the kernels taking turns.
    per_cell = [s for s in k.samples if s[1:3] == (1, 128)]
    assert [s[0] for s in per_cell] == [CUDA, TRITON] + [CUDA, TRITON] * decode_timing.REPEATS
    assert [s[3] for s in per_cell[:2]] == [1, 1]
    assert {s[3] for s in per_cell[2:] if s[0] == CUDA} == {decode_timing.MAX_CALLS}  # 1 us
    big = [s for s in k.samples if s[1:3] == (256, 8192)]
    assert {s[3] for s in big[2:]} == {1}  # milliseconds a call: one is enough


def test_the_largest_cells_go_first_and_the_budget_stops_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    k = Kernels(lambda name, b, c: 1e-3)
    ticks = itertools.count()  # the clock: one second per reading
    with caplog.at_level(logging.INFO, logger="kvrelay_kernels.decode_timing"):
        timings = decode_timing.measure(
            SHAPE, {CUDA: k.call(CUDA), TRITON: k.call(TRITON)}, cache(), timer=k.timer,
            budget_s=2.5, clock=lambda: float(next(ticks)),
        )  # fmt: skip
    # Read at 0 (the deadline is 2.5), then before each cell: 1 and 2 pass, 3 stops.
    assert {(b, c) for _, b, c in timings} == {(256, 8192), (64, 8192)}
    assert "budget of 2.5 s spent" in caplog.text
    # The smallest cell ran once per kernel before the clock (Triton's compile).
    assert k.samples[0][1:3] == (256, 8192)


def test_a_kernel_that_raises_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    k = Kernels(lambda name, b, c: 1e-4)
    k.fail.add(TRITON)
    with caplog.at_level(logging.WARNING, logger="kvrelay_kernels.decode_timing"):
        timings = decode_timing.measure(
            SHAPE, {CUDA: k.call(CUDA), TRITON: k.call(TRITON)}, cache(), timer=k.timer
        )
    assert {n for n, _, _ in timings} == {CUDA} and len(timings) == len(ALL_CELLS)
    assert "the triton kernel failed (triton cannot run this); not chosen" in caplog.text


def test_a_kernel_that_fails_at_one_cell_misses_that_cell_only() -> None:
    k = Kernels(lambda name, b, c: 1e-4)

    def timer(fn: Callable[[], object], calls: int) -> float:
        t = k.timer(fn, calls)
        if k.last == (TRITON, 256, 8192):
            raise torch.OutOfMemoryError("no room")
        return t

    timings = decode_timing.measure(
        SHAPE, {CUDA: k.call(CUDA), TRITON: k.call(TRITON)}, cache(), timer=timer
    )
    assert (TRITON, 256, 8192) not in timings and (CUDA, 256, 8192) in timings
    assert len(timings) == 2 * len(ALL_CELLS) - 1


def test_a_kernel_that_fails_between_samples_misses_that_cell_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    k = Kernels(lambda name, b, c: 1e-4)
    calls_at_cell = itertools.count()

    def timer(fn: Callable[[], object], calls: int) -> float:
        t = k.timer(fn, calls)
        if k.last == (CUDA, 16, 512) and next(calls_at_cell) == 2:  # its third sample
            raise RuntimeError("launch failed")
        return t

    with caplog.at_level(logging.WARNING, logger="kvrelay_kernels.decode_timing"):
        timings = decode_timing.measure(
            SHAPE, {CUDA: k.call(CUDA), TRITON: k.call(TRITON)}, cache(), timer=timer
        )
    assert (CUDA, 16, 512) not in timings and (TRITON, 16, 512) in timings
    assert len(timings) == 2 * len(ALL_CELLS) - 1
    assert "cuda at b16 c512 failed (launch failed)" in caplog.text


def test_cell_inputs_give_each_sequence_its_blocks_wrapping_around_the_cache() -> None:
    q, tables, lens, out = decode_timing.cell_inputs(cache(blocks=8), 4, 3, 40)
    assert q.shape == out.shape == (3, 4, 64) and q.dtype == torch.float32
    assert tables.dtype == lens.dtype == torch.int32
    assert tables.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]  # 3 blocks of 16 each
    assert lens.tolist() == [40, 40, 40]
    q16, *_ = decode_timing.cell_inputs(cache(dtype=torch.bfloat16), 4, 1, 16)
    assert q16.dtype == torch.bfloat16


def test_variants_are_the_distinct_window_and_cap_pairs_of_the_layers() -> None:
    assert decode_timing.variants_of((), None) == [(None, None)]
    assert decode_timing.variants_of((None, None), 30.0) == [(None, 30.0)]
    windows = (4096, None, 4096, None)
    assert decode_timing.variants_of(windows, 50.0) == [(None, 50.0), (4096, 50.0)]


def test_nothing_is_timed_off_a_cuda_device() -> None:
    assert not decode_timing.can_time(cache())
    assert not decode_timing.can_time(cache().to("meta"))


def test_on_the_cpu_no_decode_kernel_runs_and_no_table_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert decode_timing.supported(cache(), 4, (None, None)) == {CUDA: False, TRITON: False}
    assert decode_timing.prepare(cache(), 4, environ={}) == []
    assert decode_dispatch.installed() == []


@pytest.mark.parametrize("kernel", [CUDA, TRITON])
def test_a_pin_that_cannot_run_here_is_refused(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tests/kernels/triton_interp's conftest sets TRITON_INTERPRET=1 for the whole session
    # (Triton then "runs" on the CPU): without it, neither kernel runs here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"KVRELAY_DECODE_ATTENTION={kernel}, but the {kernel}"):
        decode_timing.prepare(cache(), 4, environ={DECODE_ATTENTION.name: kernel})


def test_an_unknown_value_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="KVRELAY_DECODE_ATTENTION='fast': use one of auto"):
        decode_timing.prepare(cache(), 4, environ={DECODE_ATTENTION.name: "fast"})


def runnable(monkeypatch: pytest.MonkeyPatch, cuda: bool = True, triton: bool = True) -> None:
    support = {CUDA: cuda, TRITON: triton}
    monkeypatch.setattr(decode_timing, "supported", lambda *_: dict(support))


def test_a_pin_installs_its_table_and_logs_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runnable(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvrelay_kernels.decode_timing"):
        tables = decode_timing.prepare(cache(), 4, environ={DECODE_ATTENTION.name: TRITON})
    assert [t.source for t in tables] == ["pinned"] and decode_dispatch.installed() == tables
    assert "pinned, triton for every step" in caplog.text


def test_injected_timings_make_the_table_one_per_variant(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runnable(monkeypatch)
    handed: list[tuple[Any, list[str]]] = []

    def measure(shape: Any, calls: Any, kv_cache: Any) -> dict[tuple[str, int, int], float]:
        handed.append((shape, sorted(calls)))
        return {(CUDA, 64, 2048): 2.0, (TRITON, 64, 2048): 1.0}

    with caplog.at_level(logging.INFO, logger="kvrelay_kernels.decode_timing"):
        tables = decode_timing.prepare(
            cache(), 4, [(None, None), (128, None)], measure_fn=measure, environ={}
        )
    assert [s.sliding_window for s, _ in handed] == [False, True]
    assert all(kernels == [CUDA, TRITON] for _, kernels in handed)
    assert [t.kernel_for(64, 2048) for t in tables] == [TRITON, TRITON]
    assert caplog.text.count("decode attention (4/2 heads x 64 float32, block 16") == 2


def test_the_budget_is_shared_by_the_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    runnable(monkeypatch)
    monkeypatch.setattr(decode_timing, "can_time", lambda _: True)
    budgets: list[float] = []

    def measure(*_: Any, budget_s: float) -> dict[tuple[str, int, int], float]:
        budgets.append(budget_s)
        return {(CUDA, 1, 128): 1.0, (TRITON, 1, 128): 2.0}

    monkeypatch.setattr(decode_timing, "measure", measure)
    decode_timing.prepare(cache(), 4, [(None, None), (64, 30.0)], environ={})
    assert budgets == [decode_timing.BUDGET_S / 2] * 2


def test_a_kernel_that_got_no_timing_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    runnable(monkeypatch)

    def only_triton(*_: Any) -> dict[tuple[str, int, int], float]:
        return {(TRITON, 64, 2048): 1.0}  # the CUDA kernel raised at every cell

    (table,) = decode_timing.prepare(cache(), 4, measure_fn=only_triton, environ={})
    assert table.kernel_for(1, 1) == table.graph_kernel_for(256) == TRITON
    (none,) = decode_timing.prepare(cache(), 4, measure_fn=lambda *_: {}, environ={})
    assert none.default == CUDA and none.source.startswith("unmeasured (no kernel could")


def test_with_one_kernel_that_runs_the_shape_nothing_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runnable(monkeypatch, triton=False)
    handed: list[Any] = []

    def measure(*args: Any) -> dict[tuple[str, int, int], float]:
        handed.append(args)
        return {}

    (table,) = decode_timing.prepare(cache(), 4, measure_fn=measure, environ={})
    assert handed == [] and table.kernel_for(256, 8192) == CUDA
    assert table.source == "only the cuda kernel runs it"
    runnable(monkeypatch, cuda=False)
    (table,) = decode_timing.prepare(cache(), 4, measure_fn=measure, environ={})
    assert handed == [] and table.graph_kernel_for(1) == TRITON


def test_the_cuda_kernel_is_refused_a_variant_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay_kernels import cuda_backend

    monkeypatch.setattr(cuda_backend, "decode_kernel_runs", lambda *_: True)
    monkeypatch.setattr(cuda_backend, "SOFT_CAP", False)
    assert decode_timing.supported(cache(), 4, (None, None))[CUDA]
    assert decode_timing.supported(cache(), 4, (64, None))[CUDA]
    assert not decode_timing.supported(cache(), 4, (None, 30.0))[CUDA]


def test_a_model_s_config_gives_its_heads_and_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, list[Any]]] = []

    def prepare(kv: torch.Tensor, heads: int, variants: list[Any]) -> list[Any]:
        seen.append((heads, variants))
        return []

    monkeypatch.setattr(decode_timing, "prepare", prepare)

    class Config:
        num_attention_heads = 4
        layer_windows = (None, 512)
        attn_logit_softcapping = None

    class Model:
        config = Config()

    decode_timing.prepare_for_model(Model(), cache())
    assert seen == [(4, [(None, None), (512, None)])]


def test_timing_launches_are_not_counted_as_served_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay_kernels.counters import COUNTERS

    runnable(monkeypatch)

    def measure(*_: Any) -> dict[tuple[str, int, int], float]:
        COUNTERS.cuda_decode_calls += 96  # what the CUDA kernel's timed calls count
        return {(CUDA, 1, 128): 1.0, (TRITON, 1, 128): 2.0}

    before = COUNTERS.cuda_decode_calls
    decode_timing.prepare(cache(), 4, measure_fn=measure, environ={})
    assert COUNTERS.cuda_decode_calls == before
