"""Block tables kept on the device and updated incrementally (issue 14).

A persistent `[rows, max_blocks]` int32 tensor on the device; each request that runs owns a
row. Each step the host compares every scheduled request's block list with its mirror of
what the row holds and writes only what changed: a decode step appends at most one block per
request, so instead of re-sending every table each step, a handful of ints go up. Anything
that rewrites a table (a preemption that freed and re-allocated it, a copy-on-write fork's
new last block, a row re-used by another request) shows up as a difference from the mirror,
so the device rows always equal a full rebuild.

Host side only here: `update` returns the entries to write; the caller uploads them with the
rest of the step (staging.py) and calls `apply` with the device copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TableUpdate:
    """One step's changes: the row of each scheduled request, in order, and the flat indices
    (`row * max_blocks + column`) and values of the entries to write."""

    rows: list[int]
    write_index: list[int]
    write_value: list[int]


class DeviceBlockTable:
    """`[rows, max_blocks]` int32 block ids on `device`, one row per running request."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.device = device
        self.table = torch.zeros(max(rows, 1), max_blocks, dtype=torch.int32, device=device)
        self._row_of: dict[str, int] = {}
        self._mirror: list[list[int]] = [[] for _ in range(self.table.shape[0])]
        self._free = list(range(self.table.shape[0] - 1, -1, -1))  # pop() takes row 0 first

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0])

    def update(self, request_ids: Sequence[str], tables: Sequence[list[int]]) -> TableUpdate:
        """Rows for this step's requests and the entries to write (host work only).

        Rows of requests not in this step are freed first (finished, preempted, or skipped
        this step: a skipped one gets a row back, rewritten, when it next runs); the table
        grows (`grow`, on the device, no sync) when a step holds more requests than rows.

        Raises:
            ValueError: a table longer than `max_blocks` (a sequence past max_model_len).
        """
        scheduled = set(request_ids)
        for request_id in [r for r in self._row_of if r not in scheduled]:
            self._free.append(self._row_of.pop(request_id))
        if len(request_ids) > self.num_rows:
            self.grow(len(request_ids))
        rows: list[int] = []
        write_index: list[int] = []
        write_value: list[int] = []
        for request_id, blocks in zip(request_ids, tables, strict=True):
            if len(blocks) > self.max_blocks:
                raise ValueError(
                    f"request {request_id!r} holds {len(blocks)} blocks, more than the "
                    f"{self.max_blocks} a sequence of max_model_len needs"
                )
            row = self._row_of.get(request_id)
            if row is None:
                row = self._row_of[request_id] = self._free.pop()
            rows.append(row)
            start = _first_difference(self._mirror[row], blocks)
            if start < len(blocks):
                base = row * self.max_blocks
                write_index.extend(range(base + start, base + len(blocks)))
                write_value.extend(blocks[start:])
            self._mirror[row] = list(blocks)
        return TableUpdate(rows, write_index, write_value)

    def grow(self, rows: int) -> None:
        """At least `rows` rows (doubling), the existing ones kept (a device copy)."""
        new_rows = max(rows, 2 * self.num_rows)
        bigger = torch.zeros(new_rows, self.max_blocks, dtype=torch.int32, device=self.device)
        bigger[: self.num_rows] = self.table
        self._free = list(range(new_rows - 1, self.num_rows - 1, -1)) + self._free
        self._mirror.extend([] for _ in range(new_rows - self.num_rows))
        self.table = bigger

    def apply(self, write_index: torch.Tensor, write_value: torch.Tensor) -> None:
        """Write `update`'s entries, given as device tensors (int64 index, int32 values)."""
        if write_index.numel():
            self.table.view(-1).index_copy_(0, write_index, write_value)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's `[len(rows), width]` block tables, from device row indices."""
        return self.table[:, :width].index_select(0, rows)


def _first_difference(old: list[int], new: list[int]) -> int:
    """The first column where `new` differs from `old` (len(new) when it only extends it)."""
    if len(old) <= len(new) and new[: len(old)] == old:
        return len(old)
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return i
    return min(len(old), len(new))
