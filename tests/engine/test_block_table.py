"""The device-resident block table (block_table.py) against a full rebuild every step, over
random add / grow / finish / preempt / fork (copy-on-write) / skip sequences: the gathered
tables must equal the padded host tables exactly, zeros included."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvrelay.engine.block_table import DeviceBlockTable, _padded
from kvrelay.engine.runner import padded_block_table


def _rebuild(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _step(table: DeviceBlockTable, live: dict[str, list[int]], ids: list[str]) -> int:
    """One step over `ids`: the gathered rows must equal the rebuilt tables. Returns how many
    entries were written."""
    tables = [live[i] for i in ids]
    update = table.update(ids, tables)
    assert len(set(update.rows.tolist())) == len(ids), "two requests share a row"
    assert update.write_index.dtype == np.int64 and update.write_value.dtype == np.int32
    table.apply(torch.from_numpy(update.write_index), torch.from_numpy(update.write_value))
    width = max(len(t) for t in tables)
    got = table.gather(torch.from_numpy(update.rows), width)
    assert torch.equal(got, _rebuild(tables, width))
    assert np.array_equal(table.table.numpy(), table._mirror)  # the mirror is the device's
    return len(update.write_index)


@pytest.mark.parametrize("seed", range(12))
def test_incremental_table_equals_a_full_rebuild(seed: int) -> None:
    rng = random.Random(seed)
    max_blocks = 12
    table = DeviceBlockTable(rows=2, max_blocks=max_blocks, device=torch.device("cpu"))
    live: dict[str, list[int]] = {}
    next_id = 0
    next_block = 1

    def fresh(n: int) -> list[int]:
        nonlocal next_block
        blocks = list(range(next_block, next_block + n))
        next_block += n
        return blocks

    writes = rebuilt = 0
    for _ in range(60):
        op = rng.choice(["add", "grow", "grow", "grow", "finish", "preempt", "fork"])
        if op == "add" or not live:
            live[f"r{next_id}"] = fresh(rng.randint(1, 4))
            next_id += 1
        elif op == "grow":
            rid = rng.choice(sorted(live))
            if len(live[rid]) < max_blocks:
                live[rid].append(fresh(1)[0])
        elif op == "finish":
            del live[rng.choice(sorted(live))]
        elif op == "preempt":  # blocks freed, re-allocated elsewhere on resume
            rid = rng.choice(sorted(live))
            live[rid] = fresh(len(live[rid]))
        else:  # fork: shares the parent's blocks but its own copy of the last one (COW)
            parent = live[rng.choice(sorted(live))]
            live[f"r{next_id}"] = [*parent[:-1], fresh(1)[0]]
            next_id += 1
        if not live:
            continue
        # Some steps skip requests (token budget): they lose their row and get it back.
        ids = [r for r in sorted(live) if rng.random() > 0.2] or sorted(live)[:1]
        rng.shuffle(ids)
        writes += _step(table, live, ids)
        rebuilt += sum(len(live[i]) for i in ids)
    assert 0 < writes < rebuilt / 2  # far fewer entries sent than a rebuild every step


@pytest.mark.parametrize("seed", range(12))
def test_rewriting_only_the_changed_rows_equals_a_full_rebuild(seed: int) -> None:
    """`update_changed` (told which tables changed, and which only grew by one block) and
    `update` (given every table), mixed at random over the same table: after each step the
    gathered tables equal the rebuilt ones, zeros included, and the mirror equals the device."""
    rng = random.Random(seed)
    max_blocks = 10
    table = DeviceBlockTable(rows=1, max_blocks=max_blocks, device=torch.device("cpu"))
    live: dict[str, list[int]] = {}
    changed: set[str] = set()
    appended: set[str] = set()  # grown by one block only, as kv_cache_manager tells them
    blocks = iter(range(1, 10_000))
    partial = full = 0
    appends = _count_appends(table)
    for step in range(80):
        op = rng.choice(["add", "grow", "grow", "grow", "finish", "preempt", "fork", "none"])
        rid = rng.choice(sorted(live)) if live else None
        one_more = False
        if op == "add" or rid is None:
            rid = f"r{step}"
            live[rid] = [next(blocks) for _ in range(rng.randint(1, 5))]
        elif op == "grow" and len(live[rid]) < max_blocks:
            live[rid].append(next(blocks))
            one_more = True
        elif op == "finish":
            del live[rid]
        elif op == "preempt":  # freed, then re-allocated shorter or longer
            live[rid] = [next(blocks) for _ in range(rng.randint(1, max_blocks))]
        elif op == "fork":  # the parent's blocks, then its own copy of the last one
            live[rid + "f"] = [*live[rid][:-1], next(blocks)]
            rid += "f"
        if one_more and rid not in appended | changed:
            appended.add(rid)
        else:  # grown twice, or changed otherwise: compared and rewritten
            changed.add(rid)
        if not live:
            continue
        ids = [r for r in sorted(live) if rng.random() > 0.2] or sorted(live)[:1]
        rng.shuffle(ids)
        if rng.random() < 0.7:
            update, width = table.update_changed(ids, changed, live.__getitem__, appended - changed)
            partial += 1
        else:
            update, width = table.update(ids, [live[i] for i in ids]), 0
            full += 1
        changed, appended = set(), set()
        table.apply(torch.from_numpy(update.write_index), torch.from_numpy(update.write_value))
        longest = max(len(live[i]) for i in ids)
        assert width in (0, longest)
        got = table.gather(torch.from_numpy(update.rows), longest)
        assert torch.equal(got, _rebuild([live[i] for i in ids], longest))
        assert np.array_equal(table.table.numpy(), table._mirror)
    assert appends[0] >= 3, "no row took the one-block way"
    assert partial > 20 and full > 5


def test_a_table_told_appended_that_is_not_one_block_longer_is_rewritten() -> None:
    """The one-block way writes only a table exactly one block longer than its row (else
    its row is compared and rewritten: exact either way)."""
    table = DeviceBlockTable(rows=2, max_blocks=6, device=torch.device("cpu"))
    appends = _count_appends(table)
    live = {"a": [3, 4], "b": [7]}

    def step(appended: set[str]) -> Any:
        update, width = table.update_changed(["a", "b"], set(), live.__getitem__, appended)
        table.apply(torch.from_numpy(update.write_index), torch.from_numpy(update.write_value))
        return update, width

    step(set())
    live["a"].append(5)
    live["b"] = [8, 9, 10]  # told appended, but rewritten and two blocks longer
    update, width = step({"a", "b"})
    assert appends == [0] and width == 3
    assert sorted(update.write_value.tolist()) == [5, 8, 9, 10]
    live["a"].append(6)
    update, width = step({"a"})
    assert appends == [1] and update.write_value.tolist() == [6] and width == 4
    got = table.gather(torch.from_numpy(update.rows), 4)
    assert got.tolist() == [[3, 4, 5, 6], [8, 9, 10, 0]]


def _count_appends(table: DeviceBlockTable) -> list[int]:
    """Counts the rows `update_changed` wrote the one-block way (in a list it keeps)."""
    count = [0]
    append = table._append

    def counted(request_ids: list[str], table_of: Any) -> Any:
        written = append(request_ids, table_of)
        count[0] += 0 if written is None else len(request_ids)
        return written

    table._append = counted  # type: ignore[method-assign]
    return count


def test_only_changed_and_newly_placed_rows_are_read() -> None:
    """A decode step reads no table but the changed ones (and those of requests new to the
    table); a block past a row's table is refused rather than read as zero."""
    table = DeviceBlockTable(rows=2, max_blocks=6, device=torch.device("cpu"))
    live = {"a": [3, 4], "b": [7]}
    read: list[str] = []

    def table_of(request_id: str) -> list[int]:
        read.append(request_id)
        return live[request_id]

    update, width = table.update_changed(["a", "b"], set(), table_of)
    assert sorted(read) == ["a", "b"] and width == 2  # both new to the table
    assert len(update.write_index) == 3
    read.clear()
    update, width = table.update_changed(["b", "a"], set(), table_of)
    assert read == [] and len(update.write_index) == 0 and width == 2
    live["b"].append(9)
    update, width = table.update_changed(["a", "b"], {"b", "gone"}, table_of)
    assert read == ["b"] and update.write_value.tolist() == [9]
    rows = update.rows
    assert table.blocks_at(rows, np.array([1, 1])).tolist() == [4, 9]
    with pytest.raises(ValueError, match="past its block table"):
        table.blocks_at(rows, np.array([2, 0]))
    live["b"] = list(range(1, 8))
    with pytest.raises(ValueError, match="'b' holds 7 blocks, more than the 6"):
        table.update_changed(["a", "b"], {"b"}, table_of)


def test_a_decode_step_writes_only_the_new_block() -> None:
    table = DeviceBlockTable(rows=4, max_blocks=8, device=torch.device("cpu"))
    live = {"a": [3, 4], "b": [7]}
    assert _step(table, live, ["a", "b"]) == 3
    assert _step(table, live, ["a", "b"]) == 0  # same tables: nothing goes up
    live["a"].append(9)
    assert _step(table, live, ["b", "a"]) == 1  # order changes nothing; one new entry
    live["b"] = [7, 11]
    live["c"] = [5, 6]
    assert _step(table, live, ["a", "b", "c"]) == 3


def test_rows_grow_and_tables_past_max_blocks_are_refused() -> None:
    table = DeviceBlockTable(rows=1, max_blocks=3, device=torch.device("cpu"))
    live = {str(i): [i + 1] for i in range(5)}
    _step(table, live, sorted(live))
    assert table.num_rows >= 5
    with pytest.raises(ValueError, match="more than the 3"):
        table.update(["x"], [[1, 2, 3, 4]])


def test_the_runners_padded_table_is_taken_as_it_is() -> None:
    """`update` with the runner's padded array writes what it would have built itself; a
    step of the same requests reuses its rows (no per-request work) and a new one frees the
    rows of requests it leaves out."""
    tables = [[4, 5, 6], [], [9]]
    assert np.array_equal(padded_block_table([[4, 5, 6], [1], [9]]), _padded([[4, 5, 6], [1], [9]]))
    assert _padded(tables).tolist() == [[4, 5, 6], [0, 0, 0], [9, 0, 0]]
    a = DeviceBlockTable(rows=4, max_blocks=8, device=torch.device("cpu"))
    b = DeviceBlockTable(rows=4, max_blocks=8, device=torch.device("cpu"))
    got_a = a.update(["x", "y", "z"], tables)
    got_b = b.update(["x", "y", "z"], tables, padded_block_table([[4, 5, 6], [0], [9]]))
    for name in ("rows", "write_index", "write_value"):
        assert np.array_equal(getattr(got_a, name), getattr(got_b, name))
    assert a.update(["x", "y", "z"], tables).rows is got_a.rows  # same requests, same array
    wide = DeviceBlockTable(rows=4, max_blocks=8, device=torch.device("cpu"))
    got_wide = wide.update(["x", "y", "z"], tables, _padded(tables).astype(np.int64))
    assert got_wide.write_value.dtype == np.int32  # the table's dtype, whatever came in
    assert np.array_equal(got_wide.write_value, got_a.write_value)
    assert a.update(["z", "w"], [[9], [2]]).rows.tolist() == [2, 1]  # w takes y's freed row


class _Ops(TorchDispatchMode):
    """The names of the torch ops called inside."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_step_makes_one_device_op_per_write_and_gather() -> None:
    """No op for a step without writes; one `index_copy_` when there are; one `index_select`
    for the tables, over a column view made once per width."""
    table = DeviceBlockTable(rows=2, max_blocks=4, device=torch.device("meta"))
    index = torch.zeros(2, dtype=torch.int64, device="meta")
    value = torch.zeros(2, dtype=torch.int32, device="meta")
    rows = torch.zeros(2, dtype=torch.int64, device="meta")
    no_index, no_value = index[:0], value[:0]
    with _Ops() as ops:
        table.apply(no_index, no_value)
    assert ops.names == []
    with _Ops() as ops:
        table.apply(index, value)
        table.gather(rows, 3)
    assert ops.names == ["index_copy_", "slice", "index_select"]
    with _Ops() as ops:
        assert table.gather(rows, 3).shape == (2, 3)
    assert ops.names == ["index_select"]
