"""The device-resident block table (block_table.py) against a full rebuild every step, over
random add / grow / finish / preempt / fork (copy-on-write) / skip sequences."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay.engine.block_table import DeviceBlockTable, _first_difference


def _rebuild(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _step(table: DeviceBlockTable, live: dict[str, list[int]], ids: list[str]) -> int:
    """One step over `ids`: the gathered rows must equal the rebuilt tables. Returns how many
    entries were written."""
    tables = [live[i] for i in ids]
    update = table.update(ids, tables)
    assert len(set(update.rows)) == len(ids), "two requests share a row"
    table.apply(
        torch.tensor(update.write_index, dtype=torch.int64),
        torch.tensor(update.write_value, dtype=torch.int32),
    )
    width = max(len(t) for t in tables)
    got = table.gather(torch.tensor(update.rows, dtype=torch.int64), width)
    # Padding past a table's end is never read by a kernel: compare the real entries.
    for row, blocks in zip(got.tolist(), tables, strict=True):
        assert row[: len(blocks)] == blocks
    expected = _rebuild(tables, width)
    mask = expected != 0
    assert torch.equal(got[mask], expected[mask])
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


def test_first_difference() -> None:
    assert _first_difference([], [1, 2]) == 0
    assert _first_difference([1, 2], [1, 2, 3]) == 2
    assert _first_difference([1, 2], [1, 5, 3]) == 1
    assert _first_difference([1, 2, 3], [1, 2]) == 2
    assert _first_difference([4], [4]) == 1
