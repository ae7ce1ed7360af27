"""Per-step attention metadata, digested once and shared by every layer.

Splitting the batch into decode tokens (one query each, batched together) and prefill chunks
(one causal attention each) is what keeps the torch path free of per-token Python loops. The
same split lets the `cuda` backend send decode rows to its decode kernel and prefill rows to
the Triton varlen kernel in one step: the plan says where each kind's rows and sequences are,
as plain spans when they are contiguous (views, no copy) and as index tensors otherwise.

Everything here is computed on the host, from host tensors, once per step: reading a value of
a device tensor would be a sync. That is also where slots are bounds-checked (`num_slots`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

Span = tuple[int, int]  # [start, end) of rows or sequences


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with more than one query token this step."""

    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64

    def to(self, device: torch.device, non_blocking: bool = False) -> PrefillChunk:
        return replace(self, block_ids=self.block_ids.to(device, non_blocking=non_blocking))


@dataclass(frozen=True)
class AttentionPlan:
    """The batch of one step, split by kind.

    `decode_*` are None when the step has no single-token sequence.
    """

    # [num_decodes] int64 query row of each decode; None when every row is a decode, in order
    # (the common all-decode step needs no gather or scatter of queries).
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    # (The reference's padding mask is `decode_mask`, derived from `decode_lens` on first use:
    # built with the plan it was a [decodes, context] host tensor uploaded every step.)
    decode_context: int  # keys each decode reads (padded to the longest)
    prefills: tuple[PrefillChunk, ...]
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64 context of each decode
    # Where `write_kv` puts each new token, split once per step instead of once per layer;
    # None when the plan was built without a slot mapping. With padding (negative) slots
    # they describe the kept tokens only, `slot_keep` their rows.
    slot_blocks: torch.Tensor | None = None  # [kept] int64
    slot_offsets: torch.Tensor | None = None  # [kept] int64
    slot_keep: torch.Tensor | None = None  # [kept] int64 rows; None when no slot is padding
    # The split, for backends that run decodes and prefills with different kernels. Spans are
    # set when that kind's sequences (and so their query rows) are contiguous.
    decode_rows: Span | None = None
    decode_seqs: Span | None = None
    decode_seq_idx: torch.Tensor | None = None  # [num_decodes] int64 when not a span
    prefill_rows: Span | None = None
    prefill_seqs: Span | None = None
    # When the prefills are not contiguous (and the step has decodes too): their query rows,
    # their sequences, and their query offsets re-based to the gathered rows.
    prefill_token_idx: torch.Tensor | None = None  # [prefill tokens] int64
    prefill_seq_idx: torch.Tensor | None = None  # [num_prefills] int64
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills + 1] int32
    # CUDA graphs: a fixed split-K partition count (0: the kernel decides per call) and the
    # preallocated fp32 scratch it needs, so a captured launch never changes shape.
    decode_partitions: int = 0
    decode_workspace: torch.Tensor | None = None

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """`[decodes, 1, 1, context]` bool: which of the padded context each decode reads, for
        the torch reference (the kernels read `decode_lens`). Built on first use, once per
        plan, on the lengths' device; None when every decode reads all of it (known on the
        host only: reading a device value would be a sync)."""
        lens, context = self.decode_lens, self.decode_context
        if lens is None or (lens.device.type == "cpu" and int(lens.min()) == context):
            return None
        positions = torch.arange(context, device=lens.device)
        return (positions.unsqueeze(0) < lens.unsqueeze(1)).view(lens.shape[0], 1, 1, context)

    @property
    def has_decodes(self) -> bool:
        return self.decode_block_tables is not None

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionPlan:
        """The plan with `fn` applied to every tensor (its ints and spans unchanged)."""
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        changes["prefills"] = tuple(replace(c, block_ids=fn(c.block_ids)) for c in self.prefills)
        return replace(self, **changes)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the plan, in `map_tensors` order."""
        found: list[torch.Tensor] = []
        self.map_tensors(lambda t: found.append(t) or t)  # type: ignore[func-returns-value]
        return found

    def to(self, device: torch.device, non_blocking: bool = False) -> AttentionPlan:
        """The plan with every tensor on `device`; its ints (query spans, context lengths)
        stay Python values, so kernels read them without a host sync."""
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))


def split_slots(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots -> (block ids, offsets), dropping negative (padding) slots' tokens is the caller's
    job: see `write_kv`."""
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    return blocks, slot_mapping - blocks * block_size


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> bool:
    """Whether any slot is padding (negative), after checking on the host that none is past
    the cache (`num_slots` = blocks x block size): a CUDA `write_kv` trusts its slots.

    Raises:
        ValueError: a slot at or past `num_slots`.
    """
    if slot_mapping.numel() == 0:
        return False
    low, high = (int(v) for v in torch.aminmax(slot_mapping))
    if high >= num_slots:
        raise ValueError(
            f"slot {high} is outside the KV cache's {num_slots} slots: a block id past "
            "the cache's blocks (the block table and the cache disagree)"
        )
    return low < 0


def _span(values: list[int]) -> Span | None:
    """[first, last + 1) when `values` are consecutive, else None."""
    if values and values[-1] - values[0] == len(values) - 1:
        return (values[0], values[-1] + 1)
    return None


def build_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor | None = None,
    *,
    num_slots: int | None = None,
) -> AttentionPlan:
    """Digest the step's metadata (see `paged_attention` for the meaning of each argument).

    With `slot_mapping`, `write_kv` reuses its block / offset split; padding (negative) slots
    are dropped there by `slot_keep`, without a device sync. With `num_slots`, slots are
    checked against the cache's size (`check_slots`).
    """
    slot_blocks, slot_offsets, slot_keep = _slot_split(slot_mapping, block_size, num_slots)
    slots: dict[str, Any] = {
        "slot_blocks": slot_blocks,
        "slot_offsets": slot_offsets,
        "slot_keep": slot_keep,
    }
    # Vectorized over the batch: the engine builds a plan every step, for every running
    # sequence (a per-sequence Python loop cost ~0.1 ms a step at 256 decodes).
    qsl = query_start_loc.numpy().astype(np.int64)
    lens = seq_lens.numpy().astype(np.int64)
    q_lens = np.diff(qsl)
    decode_seqs = np.flatnonzero(q_lens == 1)
    prefill_seqs = np.flatnonzero(q_lens > 1).tolist()
    starts = qsl.tolist()
    prefills = tuple(
        PrefillChunk(
            starts[i], starts[i + 1], int(lens[i]),
            block_tables[i, : -(-int(lens[i]) // block_size)].to(torch.int64),
        )
        for i in prefill_seqs
    )  # fmt: skip
    split = _prefill_split(prefill_seqs, starts, bool(decode_seqs.size))
    if not decode_seqs.size:
        return AttentionPlan(
            decode_token_idx=None, decode_block_tables=None, decode_context=0,
            prefills=prefills, **slots, **split,
        )  # fmt: skip
    return _with_decodes(block_tables, block_size, qsl, lens, decode_seqs, prefills, slots, split)


def _with_decodes(
    block_tables: torch.Tensor,
    block_size: int,
    qsl: npt.NDArray[np.int64],
    lens: npt.NDArray[np.int64],
    decode_seqs: npt.NDArray[np.intp],
    prefills: tuple[PrefillChunk, ...],
    slots: dict[str, Any],
    split: dict[str, Any],
) -> AttentionPlan:
    """`build_plan`'s plan for a step with decodes (`decode_seqs`: their sequences)."""
    num_decodes = int(decode_seqs.size)
    dec_lens = lens[decode_seqs]
    longest = int(dec_lens.max())
    max_blocks = -(-longest // block_size)
    first = int(decode_seqs[0])
    contiguous = int(decode_seqs[-1]) - first == num_decodes - 1
    seq_idx = None if contiguous else torch.from_numpy(decode_seqs.astype(np.int64))
    if seq_idx is None:
        tables = block_tables[first : first + num_decodes, :max_blocks].to(torch.int64)
    else:
        tables = block_tables[seq_idx, :max_blocks].to(torch.int64)
    # Every query row a decode, in order: the kernels need no gather or scatter of queries.
    all_rows = num_decodes == int(qsl[-1])
    decode_rows = qsl[decode_seqs]
    first_row = int(decode_rows[0])
    return AttentionPlan(
        decode_token_idx=None if all_rows else torch.from_numpy(decode_rows),
        decode_block_tables=tables,
        decode_context=longest,
        prefills=prefills,
        decode_lens=torch.from_numpy(dec_lens),
        **slots,
        decode_rows=(first_row, first_row + num_decodes) if contiguous else None,
        decode_seqs=(first, first + num_decodes) if contiguous else None,
        decode_seq_idx=seq_idx,
        **split,
    )


def plan_on_device(
    device: torch.device,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> tuple[AttentionPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a caller that passes no plan: the plan, built on the host from host copies of the
    metadata (reading device metadata is a sync; a direct caller pays it, the engine never
    does), with the plan's index tensors and the metadata itself on `device` (the query's),
    so every gather of a split step indexes a tensor on its own device.

    Returns:
        (plan, block_tables, seq_lens, query_start_loc), all on `device`.
    """
    on_host = build_plan(block_tables.cpu(), seq_lens.cpu(), query_start_loc.cpu(), block_size)
    plan = on_host.to(device)
    tables, lens, starts = (t.to(device) for t in (block_tables, seq_lens, query_start_loc))
    return plan, tables, lens, starts


def _slot_split(
    slot_mapping: torch.Tensor | None, block_size: int, num_slots: int | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`write_kv`'s (blocks, offsets, kept rows) of the step's slots: padding (negative) slots
    dropped by the kept rows (None: all kept); checked against `num_slots` when given."""
    if slot_mapping is None:
        return None, None, None
    padded = (
        check_slots(slot_mapping, num_slots)
        if num_slots is not None
        else bool(slot_mapping.numel()) and int(slot_mapping.min()) < 0
    )
    kept, slot_keep = slot_mapping.to(torch.int64), None
    if padded:
        slot_keep = torch.nonzero(kept >= 0).flatten()
        kept = kept[slot_keep]
    blocks, offsets = split_slots(kept, block_size)
    return blocks, offsets, slot_keep


def _prefill_split(prefill_seqs: list[int], starts: list[int], mixed: bool) -> dict[str, Any]:
    """The prefills' rows and sequences: spans when contiguous; index tensors otherwise (only
    needed when decodes share the step: a prefill-only step runs the whole batch as one)."""
    if not prefill_seqs:
        return {}
    span = _span(prefill_seqs)
    if span is not None:
        return {"prefill_seqs": span, "prefill_rows": (starts[span[0]], starts[span[1]])}
    if not mixed:
        return {}
    rows = [r for i in prefill_seqs for r in range(starts[i], starts[i + 1])]
    q_lens = [starts[i + 1] - starts[i] for i in prefill_seqs]
    offsets = [0]
    for n in q_lens:
        offsets.append(offsets[-1] + n)
    return {
        "prefill_token_idx": torch.tensor(rows, dtype=torch.int64),
        "prefill_seq_idx": torch.tensor(prefill_seqs, dtype=torch.int64),
        "prefill_query_start_loc": torch.tensor(offsets, dtype=torch.int32),
    }
