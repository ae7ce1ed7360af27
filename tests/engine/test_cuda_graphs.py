"""CUDA-graph padding logic without a GPU (graph_padding.py): captured sizes, which steps
replay, the split-K partition count and workspace, the static inputs' padding, and that
padded rows never change the real rows' outputs or the cache (torch reference, CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.cuda_graphs import DecodeGraphs
from kvrelay.engine.graph_padding import (
    PAD_SLOT,
    StaticDecodeInputs,
    capture_sizes,
    padded_size,
    replays,
)
from kvrelay.models.inputs import AttentionInputs
from kvrelay.models.loader import load_model
from kvrelay_kernels import cuda_backend, select_backend
from kvrelay_kernels.counters import COUNTERS
from tests.engine.conftest import EngineFactory, load_model_config_135m, run_to_completion

CPU = torch.device("cpu")


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(1) == [1] and capture_sizes(2) == [1, 2]
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 3, 8, 9, 65, 100)] == [1, 4, 8, 16, 100, 100]
    assert padded_size(0, sizes) is None and padded_size(101, sizes) is None


def _plan(q_lens: list[int], seq_lens: list[int]) -> tuple[AttentionInputs, int]:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    tables = torch.tensor([[i + 1, 0, 0] for i in range(len(q_lens))], dtype=torch.int32)
    attn = AttentionInputs.build(
        slot_mapping=torch.arange(starts[-1], dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_size=16,
    )
    return attn, starts[-1]


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "expected"),
    [
        ([1, 1, 1], [5, 9, 2], 4),  # pure decode: the graph of 4, one row padded
        ([1], [30], 1),
        ([1] * 8, [3] * 8, 8),
        ([1, 4, 1], [5, 9, 2], None),  # a prefill chunk in the step: eager
        ([6], [6], None),  # prefill only
        ([1] * 9, [4] * 9, None),  # more decodes than the largest graph (8 here)
    ],
)
def test_which_steps_replay_a_graph(
    q_lens: list[int], seq_lens: list[int], expected: int | None
) -> None:
    attn, num_tokens = _plan(q_lens, seq_lens)
    assert replays(attn.plan, num_tokens, capture_sizes(8)) == expected


def test_fixed_partition_count_and_workspace() -> None:
    assert cuda_backend.PARTITION_SIZE == 512  # kPartitionSize in kernels/csrc/kvrelay_ops.h
    header = (Path(cuda_backend.csrc_dir()) / "kvrelay_ops.h").read_text()
    assert "constexpr int kPartitionSize = 512;" in header
    assert [cuda_backend.max_partitions(n) for n in (1, 512, 513, 2048, 8192)] == [1, 1, 2, 4, 16]
    # Every partition count covers contexts up to max_model_len: parts * 512 >= length.
    for length in (1, 100, 512, 513, 4000, 131072):
        assert cuda_backend.max_partitions(length) * 512 >= length
    assert cuda_backend.split_workspace_numel(128, 9, 64, 16) == 128 * 9 * 16 * 66
    config = load_model_config_135m()
    # The 135M shape at max_num_seqs 100 (graph of 100 rows), contexts up to 8192: 16 parts.
    assert DecodeGraphs.workspace_bytes(config, 100, 8192) == 100 * 9 * 16 * 66 * 4


def test_static_inputs_pad_rows_and_the_capture_plan() -> None:
    static = StaticDecodeInputs.allocate(8, 4, CPU)
    assert (static.slot_mapping == PAD_SLOT).all() and (static.seq_lens == 1).all()
    static.block_tables.fill_(7)  # entries an earlier step left: valid block ids
    static.load(
        4,
        torch.tensor([11, 12, 13]),
        torch.tensor([4, 8, 1]),
        torch.tensor([20, 41, 50]),
        torch.tensor([5, 9, 2], dtype=torch.int32),
        torch.tensor([[1, 2], [2, 3], [3, 0]], dtype=torch.int32),
    )
    assert static.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert static.positions[:4].tolist() == [4, 8, 1, 0]
    assert static.slot_mapping[:4].tolist() == [20, 41, 50, PAD_SLOT]
    assert static.seq_lens[:4].tolist() == [5, 9, 2, 1]
    assert static.block_tables[:3, :2].tolist() == [[1, 2], [2, 3], [3, 0]]
    assert static.block_tables[3].tolist() == [7, 7, 7, 7]  # padding reads a valid block
    workspace = torch.empty(10)
    plan = static.plan(4, 2048, 4, workspace)
    assert (plan.decode_rows, plan.decode_seqs, plan.decode_context) == ((0, 4), (0, 4), 2048)
    assert plan.decode_partitions == 4 and plan.decode_workspace is workspace
    assert not plan.prefills and plan.decode_lens is not None
    assert plan.decode_lens.data_ptr() == static.seq_lens.data_ptr()  # views: replay reads them


def test_loading_a_step_makes_its_slices_once_per_shape() -> None:
    """A replay's copies go into slices of the static buffers, made once per row count and
    table width (each a device op): a later step of the same shape makes only the copies,
    and still loads its own values."""
    static = StaticDecodeInputs.allocate(8, 4, torch.device("meta"))
    ids = torch.zeros(3, dtype=torch.int64, device="meta")
    lens = torch.zeros(3, dtype=torch.int32, device="meta")
    tables = torch.zeros(3, 2, dtype=torch.int32, device="meta")
    static.load(4, ids, ids, ids, lens, tables)
    with _Ops() as ops:
        static.load(4, ids, ids, ids, lens, tables)
    assert ops.names == ["copy_"] * 5 + ["fill_"] * 4  # rows 3:4 padded
    narrow = tables[:, :1]
    with _Ops() as ops:
        static.load(3, ids, ids, ids, lens, narrow)  # a new shape: its slices, once
    assert sorted(ops.names) == ["copy_"] * 5 + ["slice"] * 6  # 4 rows, table rows and columns
    with _Ops() as ops:
        static.load(3, ids, ids, ids, lens, narrow)
    assert ops.names == ["copy_"] * 5
    cpu = StaticDecodeInputs.allocate(4, 2, CPU)
    for value in (5, 6):
        full = torch.full((2,), value)
        cpu.load(3, full, full, full, full.int(), torch.full((2, 2), value, dtype=torch.int32))
        assert cpu.input_ids[:3].tolist() == [value, value, 0]
        assert cpu.slot_mapping[:3].tolist() == [value, value, PAD_SLOT]
        assert cpu.block_tables[:2].tolist() == [[value] * 2] * 2


class _Graph:
    """Stands in for a captured `torch.cuda.CUDAGraph`: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_a_replay_returns_the_graphs_rows_without_a_slice_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`replay` (the decode path's, no plan) loads the static inputs and returns the graph's
    output itself when the step fills its size, else the step's rows as one view kept per
    shape; `decode_size` is the smallest captured size that holds the step."""
    for name in ("graph_replays", "cuda_decode_calls"):  # process-wide: put back after
        monkeypatch.setattr(COUNTERS, name, getattr(COUNTERS, name))
    replays = COUNTERS.graph_replays
    model = SimpleNamespace(config=load_model_config_135m())
    graphs = DecodeGraphs(model, torch.zeros(4, 2, 4, 3, 64), 4, 8, 64)
    assert graphs.sizes == [1, 2, 4]
    outputs = {size: torch.randn(size, 6) for size in graphs.sizes}
    graph = _Graph()
    for size, hidden in outputs.items():
        graphs._graphs[size] = (graph, hidden)  # type: ignore[assignment]
        graphs._decode_calls[size] = 0
    assert [graphs.decode_size(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]

    def step(n: int) -> torch.Tensor:
        ids = torch.arange(n) + 3
        tables = torch.ones(n, 2, dtype=torch.int32)
        lens = torch.full((n,), 5, dtype=torch.int32)
        return graphs.replay(graphs.decode_size(n) or 0, ids, ids, ids, lens, tables)

    assert step(4) is outputs[4] and step(2) is outputs[2]
    three = step(3)
    assert three.shape == (3, 6) and torch.equal(three, outputs[4][:3])
    assert step(3) is three  # the same view again: no device op
    assert graph.replays == 4 and COUNTERS.graph_replays == replays + 4
    assert graphs.static.input_ids[:4].tolist() == [3, 4, 5, 0]  # row 3 padding


class _Ops(TorchDispatchMode):
    """The names of the ops called inside on meta tensors (device ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_padded_rows_never_change_the_real_rows(tiny_llama_dir: Path) -> None:
    """A decode batch of 3 padded to 4 (and to 8), through the model on the torch reference:
    the real rows' hidden states equal the unpadded batch's, the cache gets exactly the real
    tokens' K/V, and padded rows stay finite."""
    torch.manual_seed(0)
    model, config = load_model(tiny_llama_dir, select_backend("torch"))
    block_size, num_blocks = 4, 12
    shape = (num_blocks, config.num_hidden_layers, 2, block_size)
    cache = torch.randn(*shape, config.num_key_value_heads, config.head_dim)
    seq_lens = [5, 9, 2]
    tables = [[3, 4], [6, 1, 9], [10]]
    ids = torch.tensor([17, 42, 99])
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.tensor(
        [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
         for t, n in zip(tables, seq_lens, strict=True)]
    )  # fmt: skip
    width = 3
    host_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    with torch.inference_mode():
        expected_cache = cache.clone()
        attn = AttentionInputs.build(
            slots, host_tables, lens, torch.arange(4, dtype=torch.int32), block_size, num_blocks
        )
        expected = model(ids, positions, expected_cache, attn)
        for size in (4, 8):
            got_cache = cache.clone()
            static = StaticDecodeInputs.allocate(8, 5, CPU)
            static.block_tables.fill_(11)  # stale entries from earlier steps
            static.load(size, ids, positions, slots, lens, host_tables)
            # The reference needs its host-built plan (per-row masks); the CUDA graph's
            # kernel reads the same static buffers with `static.plan`.
            padded = AttentionInputs.build(
                static.slot_mapping[:size],
                static.block_tables[:size],
                static.seq_lens[:size],
                static.query_start_loc[: size + 1],
                block_size,
                num_blocks,
            )
            hidden = model(static.input_ids[:size], static.positions[:size], got_cache, padded)
            assert hidden.shape[0] == size and hidden.isfinite().all()
            torch.testing.assert_close(hidden[:3], expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_cache, expected_cache, atol=1e-5, rtol=1e-5)
            # Nothing outside the real tokens' slots changed, bit for bit.
            changed = (got_cache != cache).flatten(1, 2).any(-1).any(-1).any(1)  # [blocks, bs]
            real = {(int(s) // block_size, int(s) % block_size) for s in slots}
            assert {tuple(x) for x in changed.nonzero().tolist()} <= real


def test_no_graphs_on_the_cpu(make_engine: EngineFactory) -> None:
    engine = make_engine()
    assert engine.runner.graphs is None and engine.runner.counters is COUNTERS
    reason = DecodeGraphs.supported(engine.runner.model, engine.kv_tensor)
    assert reason is not None and "cpu" in reason
    before = COUNTERS.eager_steps
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    run_to_completion(engine)
    assert COUNTERS.eager_steps - before == 3 and COUNTERS.graph_replays == 0
