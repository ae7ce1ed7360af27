"""One staged upload per step and the device-resident block table, run on the CPU: the staged
path (what CUDA and meta take) must give exactly the host path's values and tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from kvrelay.engine.runner import padded_block_table
from kvrelay.engine.staging import HostArray, StepStager
from kvrelay.engine.step_upload import StepUploader
from kvrelay.models.inputs import AttentionInputs
from tests.engine.conftest import EngineFactory, run_to_completion

CPU = torch.device("cpu")


def test_stager_packs_every_tensor_into_one_copy() -> None:
    stager = StepStager(CPU, initial_bytes=64)
    tensors: list[HostArray] = [
        torch.arange(5, dtype=torch.int64),
        torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.empty(0, dtype=torch.int64),
        torch.arange(40, dtype=torch.int64)[::2],  # not contiguous
        np.array([7, -8, 9], np.int32),  # numpy arrays go up as they are
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),  # no numpy dtype: its bytes go up
        torch.tensor(3, dtype=torch.int64),  # 0-d
    ]
    got = stager.upload(tensors)
    assert stager.uploads == 1
    for a, b in zip(tensors, got, strict=True):
        a = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    base = stager._device.data_ptr()
    ends = [t.data_ptr() - base for t in got if t.numel()]
    assert all(0 <= e < stager._device.numel() for e in ends)  # views of one buffer
    assert all(t.data_ptr() % 16 == 0 for t in got if t.numel())  # aligned for any dtype
    again = stager.upload([torch.full((100,), 7, dtype=torch.int64)])  # grows the buffers
    assert stager.uploads == 2 and stager._device.numel() >= 800 and int(again[0].sum()) == 700


class _Ops(TorchDispatchMode):
    """The names of the device ops (ops on a meta tensor) called inside."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in tensors):
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_step_is_one_copy_and_one_split_per_dtype() -> None:
    """Device ops (each a dispatch, ~5 us on a GPU host) do not grow with the tensors: one
    copy, one `split` per dtype, one `view` per tensor that is not 1-D (38 ops for a decode
    step's 12 tensors before: a slice and two views each); no split for a dtype whose
    layout an earlier step had."""
    stager = StepStager(torch.device("meta"))

    def step(n: int) -> list[HostArray]:
        ints: list[HostArray] = [
            torch.arange(n),
            np.arange(n + 1),
            torch.arange(n)[::2],
            np.zeros(0, np.int64),
        ]
        return [*ints, torch.ones(n, dtype=torch.int32), torch.ones(n, 1, 1, 2, dtype=torch.bool)]

    stager.upload(step(8))  # makes the kept views: the dtypes', the copy's slices
    tensors = step(9)
    with _Ops() as ops:
        got = stager.upload(tensors)
    assert sorted(ops.names) == ["copy_", "split_with_sizes", "split_with_sizes",
                                 "split_with_sizes", "view"]  # fmt: skip
    assert [tuple(t.shape) for t in got] == [(9,), (10,), (5,), (0,), (9,), (9, 1, 1, 2)]
    assert [t.dtype for t in got] == [torch.int64] * 4 + [torch.int32, torch.bool]
    # The same layout again: the kept views, only the copy and the mask's 4-D view.
    tensors = step(9)
    with _Ops() as ops:
        again = stager.upload(tensors)
    assert sorted(ops.names) == ["copy_", "view"]
    assert all(a is b for a, b in zip(got[:5], again[:5], strict=True))


def _requests(engine: Engine) -> None:
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=12))
    engine.add_request("b", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=16))
    engine.add_request(
        "c", [9] * 13, SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=10)
    )  # forks: copy-on-write of the last prompt block
    engine.add_request("d", list(range(50, 61)), SamplingParams(temperature=0.0, max_tokens=9))


def _staged(engine: Engine) -> list[int]:
    """Route `engine`'s steps through the staged path on the CPU; returns its step count."""
    runner = engine.runner
    max_blocks = -(-engine.max_total_tokens // runner.block_size)
    runner.uploader = StepUploader(CPU, max_blocks, rows=1)  # rows=1: the table must grow
    steps = [0]
    execute = runner.execute

    def counted(*args: object, **kwargs: object) -> object:
        steps[0] += 1
        return execute(*args, **kwargs)  # type: ignore[arg-type]

    runner.execute = counted  # type: ignore[method-assign,assignment]
    return steps


def test_staged_path_gives_the_host_paths_tokens(make_engine: EngineFactory) -> None:
    """Chunked prefills mixed with decodes, forks, and preemptions (a small cache): the
    staged inputs and device table give bit-identical tokens, one upload per step."""
    results = []
    for staged in (False, True):
        engine = make_engine(num_blocks=24, max_num_batched_tokens=16)
        steps = _staged(engine) if staged else None
        _requests(engine)
        results.append(run_to_completion(engine))
        if steps is not None:
            assert engine.runner.uploader is not None
            assert engine.runner.uploader.stager.uploads == steps[0] > 10
            assert engine.runner.uploader.table.num_rows >= 4
        assert engine.scheduler.num_preemptions > 0  # rows re-used, tables rewritten
    assert results[0] == results[1]
    assert len(results[0]["c"]) == 3


def test_staged_inputs_equal_the_host_inputs(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=16)
    _requests(engine)
    runner = engine.runner
    uploader = StepUploader(CPU, -(-engine.max_total_tokens // runner.block_size), rows=2)
    for _ in range(6):
        plan = engine.scheduler.schedule()
        if plan.is_empty:
            break
        tables = [engine.kv_cache.block_table(c.request.request_id) for c in plan.chunks]
        runner.uploader = None
        host = runner.prepare(plan.chunks, tables, plan.copies)
        runner.uploader = uploader
        dev = runner.prepare(plan.chunks, tables, plan.copies)
        for a, b in [
            (host.inputs.input_ids, dev.inputs.input_ids),
            (host.inputs.positions, dev.inputs.positions),
            (host.inputs.logits_indices, dev.inputs.logits_indices),
            (host.inputs.attn.slot_mapping, dev.inputs.attn.slot_mapping),
            (host.inputs.attn.seq_lens, dev.inputs.attn.seq_lens),
            (host.inputs.attn.query_start_loc, dev.inputs.attn.query_start_loc),
        ]:
            assert torch.equal(a, b)
        # The device table holds what the host built, padding zeros too.
        assert torch.equal(host.inputs.attn.block_tables, dev.inputs.attn.block_tables)
        hp, dp = host.inputs.attn.plan, dev.inputs.attn.plan
        assert len(hp.tensors()) == len(dp.tensors())
        for a, b in zip(hp.tensors(), dp.tensors(), strict=True):
            assert torch.equal(a.long() if a.dtype != torch.bool else a, b.to(a.dtype))
            # Staged, or a view of the gathered tables: no host tensor left in the plan.
            staged = uploader.stager._device, dev.inputs.attn.block_tables
            assert _storage(b) in {_storage(t) for t in staged}
        runner.uploader = None
        runner.execute(plan.chunks, tables, plan.copies)
        engine.scheduler.update_after_step(plan.chunks)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _decode_step(tables: list[list[int]], lens: list[int]) -> AttentionInputs:
    """A pure decode step (one query token per sequence) of blocks of 4 tokens."""
    table = torch.from_numpy(padded_block_table(tables))
    rows = torch.arange(len(lens))
    slots = table[rows, (torch.tensor(lens) - 1) // 4].long() * 4 + (torch.tensor(lens) - 1) % 4
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    return AttentionInputs.build(slots, table, torch.tensor(lens, dtype=torch.int32), qsl, 4)


def test_a_decode_step_takes_the_gathered_tables_whole() -> None:
    """When every sequence decodes and the decodes' tables are as wide as the step's, the
    plan's decode tables are the gathered tables themselves (no view: no device op); else a
    view of their columns, with the host plan's values."""
    uploader = StepUploader(CPU, max_blocks=8, rows=4)
    step = _decode_step([[5, 6], [7]], [6, 3])
    _, attn = uploader.upload([], step, ["a", "b"], [[5, 6], [7]])
    assert attn.plan.decode_block_tables is attn.block_tables
    assert torch.equal(attn.block_tables, step.block_tables)
    # b holds a block ahead of its 3 tokens: the tables are 3 wide, the decodes read 2.
    step = _decode_step([[5, 6], [7, 9, 4]], [7, 4])
    _, attn = uploader.upload([], step, ["a", "b"], [[5, 6], [7, 9, 4]])
    decode_tables = attn.plan.decode_block_tables
    assert decode_tables is not None and decode_tables is not attn.block_tables
    assert step.plan.decode_block_tables is not None
    assert torch.equal(decode_tables.long(), step.plan.decode_block_tables)
