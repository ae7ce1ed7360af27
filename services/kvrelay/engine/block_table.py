"""Block tables kept on the device and updated incrementally (issue 14).

A persistent `[rows, max_blocks]` int32 tensor on the device; each request that runs owns a
row. The host keeps a mirror of it (numpy, same shape) and, each step, compares the step's
padded tables with the mirror's rows in one vectorized pass: only the entries that differ go
up. A decode step appends at most one block per request, so a handful of ints go up instead of
every table. Anything that rewrites a table (a preemption that freed and re-allocated it, a
copy-on-write fork's new last block, a row re-used by another request) shows up as a
difference from the mirror, and since the device rows always equal the mirror, a step's
gathered `[:, :width]` tables equal its host-built padded tables exactly, zeros included.

A pure decode step needs no tables at all: `update_changed` rewrites only the rows of the
requests whose table changed since the last step (the KV cache manager records them), so a
step of 256 decodes reads no table but those that grew a block.

Host side only here: `update` returns the entries to write; the caller uploads them with the
rest of the step (staging.py) and calls `apply` with the device copies, then `gather`.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True)
class TableUpdate:
    """One step's changes: the row of each scheduled request, in order, and the flat indices
    (`row * max_blocks + column`) and values of the entries to write."""

    rows: npt.NDArray[np.int64]
    write_index: npt.NDArray[np.int64]
    write_value: npt.NDArray[np.int32]


_LAST = operator.itemgetter(-1)
_NO_INDEX = np.zeros(0, np.int64)
_NO_VALUE = np.zeros(0, np.int32)


class DeviceBlockTable:
    """`[rows, max_blocks]` int32 block ids on `device`, one row per running request."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.device = device
        self._row_of: dict[str, int] = {}
        self._free: list[int] = []
        self._mirror = np.zeros((0, max_blocks), np.int32)  # what the device rows hold
        self._last_ids: list[str] = []  # the previous step's requests, and their rows
        self._last_rows = np.zeros(0, np.int64)
        self._new_ids: list[str] = []  # requests given a row by the last `_rows`
        # Per row, the columns that may hold a block id: every mirror entry from here on is
        # 0. Right after an update, each of the step's rows' extent is its table's length.
        self._extent = np.zeros(0, np.int64)
        self.table = torch.zeros(0, max_blocks, dtype=torch.int32, device=device)
        self._allocate(max(rows, 1))

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0])

    def _allocate(self, new_rows: int) -> None:
        """At least `new_rows` rows, the existing ones kept (a device copy, no sync), and the
        views that `apply` and `gather` index, made here once instead of once per step."""
        old = self.num_rows
        table = torch.zeros(new_rows, self.max_blocks, dtype=torch.int32, device=self.device)
        if old:
            table[:old] = self.table
        self._free = list(range(new_rows - 1, old - 1, -1)) + self._free  # pop(): lowest first
        mirror = np.zeros((new_rows, self.max_blocks), np.int32)
        mirror[:old] = self._mirror
        self._mirror = mirror
        extent = np.zeros(new_rows, np.int64)
        extent[:old] = self._extent
        self._extent = extent
        self.table = table
        self._flat = table.view(-1)
        self._columns: dict[int, torch.Tensor] = {}  # width -> table[:, :width]

    def update(
        self,
        request_ids: Sequence[str],
        tables: Sequence[list[int]],
        padded: npt.NDArray[np.int32] | None = None,
    ) -> TableUpdate:
        """Rows for this step's requests and the entries to write (host work only).

        `padded` is `tables` as one `[len(tables), longest]` int32 array, zeros after each
        table (the runner has built it already; built here when None). Rows of requests not
        in this step are freed first (finished, preempted, or skipped this step: a skipped
        one gets a row back, rewritten where it differs, when it next runs); the table grows
        (`grow`, on the device, no sync) when a step holds more requests than rows.

        Raises:
            ValueError: a table longer than `max_blocks` (a sequence past max_model_len).
        """
        if padded is None:
            padded = _padded(tables)
        self._check_width(padded, request_ids, tables)
        rows = self._rows(request_ids)
        self._new_ids = []  # compared below like every other row
        # At 256 requests of 2 blocks / of 2-57 blocks, `update` took 88 / 130 us with a
        # Python comparison per request and takes 14 / 23 us with this pass (CPU time here).
        write_index, write_value = self._rewrite(rows, padded, tables)
        return TableUpdate(rows, write_index, write_value)

    def update_changed(
        self,
        request_ids: Sequence[str],
        changed: Set[str],
        table_of: Callable[[str], list[int]],
        appended: Set[str] = frozenset(),
    ) -> tuple[TableUpdate, int]:
        """`update` without the step's tables: only the rows of requests in `changed` (their
        table changed since the last step: kv_cache_manager's `take_changed`) and of requests
        given a row now are compared and rewritten, from `table_of(request_id)`; a row of
        one in `appended` (its table only one block longer since: a decode opening a block)
        gets that block, nothing compared. Exact as long as every table change since the last
        update is in `changed` or `appended`: a row kept from the last step holds its
        request's table.

        Returns:
            The update, and the step's width: its longest table, in blocks.
        """
        rows = self._rows(request_ids)
        row_of = self._row_of
        new_ids, self._new_ids = self._new_ids, []
        stale = [r for r in dict.fromkeys((*changed, *new_ids)) if r in row_of]
        writes = []
        # Not those rewritten anyway (a row given now holds nothing of its table yet).
        rewritten = set(stale) if appended and stale else ()
        grown = [r for r in appended if r in row_of and r not in rewritten]
        if grown:
            written = self._append(grown, table_of)
            if written is None:  # not as told: compared and rewritten instead
                stale += grown
            else:
                writes.append(written)
        if stale:
            tables = [table_of(request_id) for request_id in stale]
            padded = _padded(tables)
            self._check_width(padded, stale, tables)
            stale_rows = np.fromiter(map(row_of.__getitem__, stale), np.int64, len(stale))
            writes.append(self._rewrite(stale_rows, padded, tables))
        width = int(self._extent[rows].max(initial=0))
        if not writes:
            return TableUpdate(rows, _NO_INDEX, _NO_VALUE), width
        if len(writes) == 1:
            return TableUpdate(rows, *writes[0]), width
        index, value = (np.concatenate(parts) for parts in zip(*writes, strict=True))
        return TableUpdate(rows, index, value), width

    def _append(
        self, request_ids: list[str], table_of: Callable[[str], list[int]]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None:
        """Each request's last block written after its row's entries: the flat indices and
        values written; None, having written nothing, unless every table is one block longer
        than its row and within `max_blocks`."""
        n = len(request_ids)
        tables = [table_of(request_id) for request_id in request_ids]
        rows = np.fromiter(map(self._row_of.__getitem__, request_ids), np.int64, n)
        lengths = np.fromiter(map(len, tables), np.int64, n)
        if int(lengths.max()) > self.max_blocks or not np.array_equal(
            self._extent[rows] + 1, lengths
        ):
            return None
        write_index = rows * self.max_blocks + lengths - 1
        write_value = np.fromiter(map(_LAST, tables), np.int32, n)
        self._mirror.reshape(-1)[write_index] = write_value
        self._extent[rows] = lengths
        return write_index, write_value

    def _check_width(
        self, padded: npt.NDArray[Any], request_ids: Sequence[str], tables: Sequence[list[int]]
    ) -> None:
        if padded.shape[1] > self.max_blocks:
            request_id, blocks = next(
                (r, t) for r, t in zip(request_ids, tables, strict=True) if len(t) > self.max_blocks
            )
            raise ValueError(
                f"request {request_id!r} holds {len(blocks)} blocks, more than the "
                f"{self.max_blocks} a sequence of max_model_len needs"
            )

    def _rewrite(
        self,
        rows: npt.NDArray[np.int64],
        padded: npt.NDArray[np.int32],
        tables: Sequence[list[int]],
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """Make the mirror's `rows` hold `padded` (their tables, zeros after), compared over
        every column a row may hold (a row's older, longer table is zeroed); the flat indices
        and values written."""
        width = max(padded.shape[1], int(self._extent[rows].max(initial=0)))
        if width > padded.shape[1]:
            padded = np.pad(padded, ((0, 0), (0, width - padded.shape[1])))
        changed = np.flatnonzero(self._mirror[rows, :width] != padded)
        seq, column = np.divmod(changed, width)
        write_index = rows[seq] * self.max_blocks + column
        write_value = padded.reshape(-1)[changed].astype(np.int32, copy=False)
        self._mirror.reshape(-1)[write_index] = write_value
        self._extent[rows] = np.fromiter(map(len, tables), np.int64, len(tables))
        return write_index, write_value

    def blocks_at(
        self, rows: npt.NDArray[np.int64], columns: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int32]:
        """The block id at `columns[i]` of row `rows[i]`, each within its table (read on the
        host mirror: what the device holds).

        Raises:
            ValueError: a column past its row's table (a token with no block allocated).
        """
        if columns.size and bool((columns >= self._extent[rows]).any()):
            raise ValueError("a decode's token lies past its block table: allocate it first")
        return self._mirror[rows, columns]

    def _rows(self, request_ids: Sequence[str]) -> npt.NDArray[np.int64]:
        """The row of each request, assigning free rows to new ones; the previous step's
        array when the requests are the same (a decode step's usual case: no dict work)."""
        if list(request_ids) == self._last_ids:
            return self._last_rows
        scheduled = set(request_ids)
        for request_id in [r for r in self._row_of if r not in scheduled]:
            self._free.append(self._row_of.pop(request_id))
        if len(request_ids) > self.num_rows:
            self.grow(len(request_ids))
        rows = np.empty(len(request_ids), np.int64)
        for i, request_id in enumerate(request_ids):
            row = self._row_of.get(request_id)
            if row is None:
                row = self._row_of[request_id] = self._free.pop()
                self._new_ids.append(request_id)
            rows[i] = row
        self._last_ids, self._last_rows = list(request_ids), rows
        return rows

    def grow(self, rows: int) -> None:
        """At least `rows` rows (doubling), the existing ones kept (a device copy)."""
        self._allocate(max(rows, 2 * self.num_rows))

    def apply(self, write_index: torch.Tensor, write_value: torch.Tensor) -> None:
        """Write `update`'s entries, given as device tensors (int64 index, int32 values)."""
        if write_index.numel():
            self._flat.index_copy_(0, write_index, write_value)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's `[len(rows), width]` block tables, from device row indices: one
        `index_select` over a column view kept per width (a width lasts block_size steps)."""
        columns = self._columns.get(width)
        if columns is None:
            columns = self._columns[width] = self.table[:, :width]
        return columns.index_select(0, rows)


def _padded(tables: Sequence[list[int]]) -> npt.NDArray[np.int32]:
    """`[len(tables), longest]` int32, each table's block ids then zeros."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    padded = np.zeros((len(tables), int(lens.max(initial=0))), np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
    padded[np.arange(padded.shape[1]) < lens[:, None]] = flat
    return padded
