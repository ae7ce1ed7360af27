"""A step's inputs on an accelerator: one staged upload plus the device-resident block table.

The host builds the step as on the CPU (`build_batch_inputs`: plain tensors and the plan);
this moves it to the device with one copy (staging.py) and takes the block tables from the
persistent device table (block_table.py) instead of uploading them. The plan's own block-id
tensors (the decode tables and each prefill's ids, read by the torch reference) become views
of those device tables, so no table goes up twice. A pure decode step that a CUDA graph
replays needs no plan: `upload_decodes` builds its five inputs with numpy from the persistent
table's host mirror. Nothing here reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import fields, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvrelay.engine.block_table import DeviceBlockTable
from kvrelay.engine.staging import StepStager
from kvrelay.models.inputs import AttentionInputs
from kvrelay_kernels import AttentionPlan

# The plan's fields but its block ids (those come from the device table): the ones holding
# a tensor go up. Listed once here, not by `dataclasses.fields` each step.
_PLAN_FIELDS = tuple(
    f.name for f in fields(AttentionPlan) if f.name not in ("decode_block_tables", "prefills")
)


class DecodeTensors(NamedTuple):
    """A pure decode step's inputs on the device (one token per sequence), for a graph."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64
    seq_lens: torch.Tensor  # [n] int32
    block_tables: torch.Tensor  # [n, width] int32


class StepUploader:
    """Moves each step's host-built inputs to `device` (not for the CPU: it uses them as
    they are)."""

    def __init__(self, device: torch.device, max_blocks: int, rows: int) -> None:
        self.stager = StepStager(device)
        self.table = DeviceBlockTable(rows, max_blocks, device)

    def upload(
        self,
        host: Sequence[torch.Tensor],
        attn: AttentionInputs,
        request_ids: Sequence[str],
        tables: Sequence[list[int]],
    ) -> tuple[list[torch.Tensor], AttentionInputs]:
        """`host` tensors and `attn` (built from `tables`) on the device, in one copy.

        Returns the device views of `host`, in order, and the device `AttentionInputs`."""
        update = self.table.update(request_ids, tables, attn.block_tables.numpy())
        plan = attn.plan
        plan_tensors = {
            name: value
            for name in _PLAN_FIELDS
            if isinstance(value := getattr(plan, name), torch.Tensor)
        }
        staged = self.stager.upload(
            [
                *host,
                attn.slot_mapping,
                attn.seq_lens,
                attn.query_start_loc,
                update.rows,
                update.write_index,
                update.write_value,
                *plan_tensors.values(),
            ]
        )
        n = len(host)
        slots, seq_lens, qsl, rows, write_index, write_value = staged[n : n + 6]
        self.table.apply(write_index, write_value)
        block_tables = self.table.gather(rows, attn.block_tables.shape[1])
        device_plan = _device_plan(
            plan, dict(zip(plan_tensors, staged[n + 6 :], strict=True)), block_tables, attn
        )
        return staged[:n], AttentionInputs(slots, block_tables, seq_lens, qsl, device_plan)

    def upload_decodes(
        self,
        request_ids: Sequence[str],
        tokens: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        block_size: int,
        changed: Set[str],
        table_of: Callable[[str], list[int]],
        copies: Sequence[tuple[int, int]] = (),
        appended: Set[str] = frozenset(),
    ) -> tuple[DecodeTensors, tuple[torch.Tensor, torch.Tensor] | None]:
        """A pure decode step (`tokens[i]` at `positions[i]` of request `request_ids[i]`) on
        the device in one copy, built with numpy from the persistent block table: only the
        rows of requests in `changed` (kv_cache_manager's `take_changed`) or new to the
        table are read from `table_of`, and the last block of those in `appended`. No host
        tensor and no plan: a graph replays it.

        Returns:
            The step's inputs, and the copy-on-write pairs' sources and destinations (int64,
            on the device, in the same copy) or None without copies.
        """
        update, width = self.table.update_changed(request_ids, changed, table_of, appended)
        rows = update.rows
        column, offset = np.divmod(positions, block_size)
        slots = self.table.blocks_at(rows, column).astype(np.int64) * block_size + offset
        seq_lens = (positions + 1).astype(np.int32)
        pairs = np.array(copies, np.int64).reshape(-1, 2).T  # [2, len(copies)]
        staged = self.stager.upload(
            [tokens, positions, slots, rows, update.write_index, pairs[0], pairs[1],
             seq_lens, update.write_value]
        )  # fmt: skip
        input_ids, positions_dev, slots_dev, rows_dev, write_index, src, dst = staged[:7]
        lens, write_value = staged[7:]
        self.table.apply(write_index, write_value)
        tables = self.table.gather(rows_dev, width)
        step = DecodeTensors(input_ids, positions_dev, slots_dev, lens, tables)
        return step, ((src, dst) if copies else None)


def _device_plan(
    plan: AttentionPlan,
    staged: dict[str, Any],
    block_tables: torch.Tensor,
    attn: AttentionInputs,
) -> AttentionPlan:
    """The plan with its tensors replaced by their staged copies, and its block ids by views
    of the device block tables (int32: the reference's index_select takes either); the
    tables themselves when the decodes' are all of them (no view: no device op)."""
    prefills: tuple[Any, ...] = ()
    if plan.prefills:
        starts = attn.query_start_loc.tolist()  # host tensor: no sync
        seq_of_row = {start: i for i, start in enumerate(starts[:-1])}
        prefills = tuple(
            replace(c, block_ids=block_tables[seq_of_row[c.q_start], : c.block_ids.shape[0]])
            for c in plan.prefills
        )
    decode_tables = None
    if plan.decode_block_tables is not None:
        width = plan.decode_block_tables.shape[1]
        if plan.decode_seqs is not None:
            s0, s1 = plan.decode_seqs
            whole = (s0, s1, width) == (0, *block_tables.shape)
            decode_tables = block_tables if whole else block_tables[s0:s1, :width]
        else:
            seq_idx = staged.get("decode_seq_idx")
            assert seq_idx is not None, "a plan with decodes has their span or indices"
            decode_tables = block_tables[:, :width].index_select(0, seq_idx)
    return replace(plan, **staged, prefills=prefills, decode_block_tables=decode_tables)
