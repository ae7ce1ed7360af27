"""The decode dispatch's choice (kvrelay_kernels/decode_dispatch.py) from given timings: per
cell the faster kernel with ties to CUDA, graphs per batch by summed times, the nearest timed
bucket for any step, cells timed for one kernel left out, a kernel that refuses the shape
never chosen, pins refused where they cannot run, and the per-step lookup by shape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvrelay_kernels import decode_dispatch
from kvrelay_kernels.decode_dispatch import (
    CUDA,
    TRITON,
    DecodeShape,
    DecodeTable,
    choose_table,
    kernel_for_step,
    pinned_table,
    shape_of,
)

SHAPE = DecodeShape(32, 8, 128, torch.bfloat16, 16, False, False)
BOTH = {CUDA: True, TRITON: True}


@pytest.fixture(autouse=True)
def no_tables() -> Iterator[None]:
    decode_dispatch.clear()
    yield
    decode_dispatch.clear()


def timings_of(
    cells: dict[tuple[int, int], tuple[float, float]],
) -> dict[tuple[str, int, int], float]:
    """(batch, context) -> (CUDA s, Triton s) as the dispatch's timings."""
    out: dict[tuple[str, int, int], float] = {}
    for (b, c), (cuda_s, triton_s) in cells.items():
        out[(CUDA, b, c)], out[(TRITON, b, c)] = cuda_s, triton_s
    return out


def test_each_cell_takes_the_faster_kernel() -> None:
    table = choose_table(SHAPE, timings_of({(1, 128): (1.0, 2.0), (64, 2048): (2.0, 1.0)}), BOTH)
    assert table.cells == {(1, 128): CUDA, (64, 2048): TRITON}
    assert table.kernel_for(1, 128) == CUDA and table.kernel_for(64, 2048) == TRITON
    assert table.source == "measured"


@pytest.mark.parametrize(
    ("triton_s", "kernel"),
    [(1.0, CUDA), (0.98, CUDA), (0.971, CUDA), (0.969, TRITON), (0.5, TRITON), (1.5, CUDA)],
)
def test_a_tie_within_three_percent_keeps_the_cuda_kernel(triton_s: float, kernel: str) -> None:
    table = choose_table(SHAPE, timings_of({(16, 512): (1.0, triton_s)}), BOTH)
    assert table.cells == {(16, 512): kernel}
    assert table.rows == {16: kernel}


def test_the_tie_margin_is_a_parameter() -> None:
    timings = timings_of({(16, 512): (1.0, 0.95)})
    assert choose_table(SHAPE, timings, BOTH, tie=0.0).cells[(16, 512)] == TRITON
    assert choose_table(SHAPE, timings, BOTH, tie=0.1).cells[(16, 512)] == CUDA


def test_steps_read_the_nearest_timed_cell_in_log2_distance() -> None:
    table = choose_table(
        SHAPE,
        timings_of({(1, 128): (1, 2), (1, 8192): (2, 1), (256, 128): (2, 1), (256, 8192): (1, 2)}),
        BOTH,
    )
    assert table.kernel_for(1, 100) == CUDA
    assert table.kernel_for(2, 7000) == TRITON  # (1, 8192)
    assert table.kernel_for(300, 64) == TRITON  # (256, 128): past the largest bucket
    assert table.kernel_for(200, 20000) == CUDA  # (256, 8192)
    # Context 1024 is 3 doublings from 128 and 3 from 8192: a tie goes to the longer.
    assert table.kernel_for(1, 1024) == TRITON
    # Batch 16 is 4 doublings from 1 and 4 from 256: a tie goes to the larger batch.
    assert table.kernel_for(16, 128) == TRITON
    assert table.kernel_for(0, 0) == CUDA  # no decode has no length: the smallest cell


def test_a_cell_timed_for_one_kernel_only_is_left_out() -> None:
    timings = timings_of({(1, 128): (1, 2)})
    timings[(TRITON, 64, 2048)] = 0.1  # the CUDA kernel ran out of budget there
    table = choose_table(SHAPE, timings, BOTH)
    assert table.cells == {(1, 128): CUDA}
    assert table.kernel_for(64, 2048) == CUDA  # the nearest complete cell decides
    assert table.timings[(TRITON, 64, 2048)] == 0.1  # kept for the report


def test_no_complete_cell_gives_the_cuda_kernel_everywhere() -> None:
    table = choose_table(SHAPE, {(TRITON, 64, 2048): 0.1}, BOTH)
    assert table.cells == {} and table.rows == {}
    assert table.kernel_for(64, 2048) == table.graph_kernel_for(64) == CUDA
    assert "no cell timed for both" in table.source


@pytest.mark.parametrize("only", [CUDA, TRITON])
def test_a_kernel_that_refuses_the_shape_is_never_chosen(only: str) -> None:
    other = TRITON if only == CUDA else CUDA
    fast_other = timings_of({(64, 2048): (1.0, 0.1) if other == TRITON else (0.1, 1.0)})
    table = choose_table(SHAPE, fast_other, {only: True, other: False})
    assert table.kernel_for(64, 2048) == table.graph_kernel_for(64) == only
    assert table.source == "measured (one kernel runs it)"


def test_neither_kernel_running_the_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="neither decode kernel runs 32/8 heads x 128"):
        choose_table(SHAPE, {}, {CUDA: False, TRITON: False})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_timing_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(ValueError, match=r"decode timing \('cuda', 1, 128\) must be a positive"):
        choose_table(SHAPE, {(CUDA, 1, 128): bad, (TRITON, 1, 128): 1.0}, BOTH)


def test_an_unknown_kernel_in_the_support_map_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown decode kernels \['flash'\]"):
        choose_table(SHAPE, {}, {**BOTH, "flash": True})


def test_graphs_take_the_kernel_with_the_lower_sum_over_their_batch_s_contexts() -> None:
    # CUDA wins the short contexts by a little, Triton the long ones by a lot: a graph serves
    # every context, and the long ones cost the most.
    table = choose_table(
        SHAPE,
        timings_of(
            {
                (64, 128): (10, 12),
                (64, 512): (30, 35),
                (64, 8192): (500, 300),
                (1, 128): (5, 6),
                (1, 8192): (50, 52),
            }
        ),
        BOTH,
    )
    assert table.cells[(64, 128)] == CUDA and table.cells[(64, 8192)] == TRITON
    assert table.rows == {1: CUDA, 64: TRITON}
    assert table.graph_kernel_for(1) == table.graph_kernel_for(2) == CUDA
    assert table.graph_kernel_for(8) == table.graph_kernel_for(256) == TRITON
    assert table.graph_kernel_for(4) == CUDA  # 2 doublings from 1, 4 from 64


def test_a_graph_row_ties_to_the_cuda_kernel() -> None:
    table = choose_table(SHAPE, timings_of({(16, 128): (1.0, 0.5), (16, 8192): (10.0, 10.3)}), BOTH)
    assert table.cells == {(16, 128): TRITON, (16, 8192): CUDA}
    assert table.rows == {16: CUDA}  # 11.0 vs 10.8: within 3%


@pytest.mark.parametrize("kernel", [CUDA, TRITON])
def test_a_pin_takes_every_step(kernel: str) -> None:
    table = pinned_table(SHAPE, kernel, BOTH)
    assert table.source == "pinned"
    assert table.kernel_for(1, 1) == table.kernel_for(256, 8192) == kernel
    assert table.graph_kernel_for(8) == kernel


def test_a_pin_the_shape_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="KVRELAY_DECODE_ATTENTION=cuda, but the cuda decode"):
        pinned_table(SHAPE, CUDA, {CUDA: False, TRITON: True})
    with pytest.raises(ValueError, match="decode kernel 'auto': use one of cuda, triton"):
        pinned_table(SHAPE, "auto", BOTH)


def test_the_log_line_and_the_grid_show_every_cell() -> None:
    table = choose_table(
        SHAPE, timings_of({(1, 128): (1e-5, 2e-5), (64, 2048): (2e-4, 1e-4)}), BOTH
    )
    line = table.describe()
    assert line.startswith("decode attention (32/8 heads x 128 bfloat16, block 16): measured")
    assert "b1/c128=cuda b64/c2048=triton" in line and "graphs b1=cuda b64=triton" in line
    grid = table.grid()
    assert grid[0].split() == ["batch", "c128", "c2048", "graph"]
    assert grid[1].split() == ["1", "cuda", "10/20", "-", "-/-", "cuda"]
    assert grid[2].split() == ["64", "-", "-/-", "triton", "200/100", "triton"]
    pinned = pinned_table(SHAPE._replace(soft_cap=True), TRITON, BOTH).describe()
    assert pinned.endswith("block 16 +cap): pinned, triton for every step")


def test_shape_of_reads_the_block_major_cache() -> None:
    cache = torch.empty(4, 2, 2, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    assert shape_of(cache, 32, False, False) == SHAPE
    assert shape_of(cache, 32, True, False).sliding_window


def test_steps_look_up_the_table_of_their_own_shape_and_variant() -> None:
    cache = torch.empty(4, 2, 2, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    assert kernel_for_step(32, cache, 64, 2048, graphed=False) == CUDA  # no table: as before
    cells = timings_of({(64, 2048): (2.0, 1.0), (1, 128): (1.0, 2.0)})
    decode_dispatch.install(choose_table(SHAPE, cells, BOTH))
    assert kernel_for_step(32, cache, 64, 2048, graphed=False) == TRITON
    assert kernel_for_step(32, cache, 1, 100, graphed=False) == CUDA
    assert kernel_for_step(32, cache, 64, 100, graphed=True) == TRITON  # its batch's row
    assert kernel_for_step(32, cache, 64, 2048, False, sliding_window=True) == CUDA  # no table
    assert kernel_for_step(16, cache, 64, 2048, graphed=False) == CUDA  # other heads
    fp16 = torch.empty(4, 2, 2, 16, 8, 128, dtype=torch.float16, device="meta")
    assert kernel_for_step(32, fp16, 64, 2048, graphed=False) == CUDA  # other dtype
    decode_dispatch.install(pinned_table(SHAPE._replace(sliding_window=True), TRITON, BOTH))
    assert kernel_for_step(32, cache, 1, 1, False, sliding_window=True) == TRITON
    assert len(decode_dispatch.installed()) == 2


def test_installing_a_shape_again_replaces_its_table() -> None:
    decode_dispatch.install(pinned_table(SHAPE, TRITON, BOTH))
    decode_dispatch.install(DecodeTable(SHAPE, CUDA, "unmeasured"))
    assert [t.source for t in decode_dispatch.installed()] == ["unmeasured"]


def test_a_step_s_answer_is_worked_out_once_and_forgotten_with_its_table() -> None:
    cache = torch.empty(4, 2, 2, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    decode_dispatch.install(pinned_table(SHAPE, TRITON, BOTH))
    assert kernel_for_step(32, cache, 64, 2048, graphed=False) == TRITON
    assert len(decode_dispatch._ANSWERS) == 1
    assert kernel_for_step(32, cache, 64, 2048, graphed=False) == TRITON  # every layer after
    assert len(decode_dispatch._ANSWERS) == 1
    decode_dispatch.install(pinned_table(SHAPE, CUDA, BOTH))  # a new table: new answers
    assert kernel_for_step(32, cache, 64, 2048, graphed=False) == CUDA
    for context in range(decode_dispatch._MAX_ANSWERS + 10):  # a context per step
        kernel_for_step(32, cache, 64, context, graphed=False)
    assert len(decode_dispatch._ANSWERS) <= decode_dispatch._MAX_ANSWERS
    decode_dispatch.clear()
    assert decode_dispatch._ANSWERS == {}
    assert kernel_for_step(32, cache, 64, 2048, graphed=False) == CUDA
