"""Merge a pull's block id pairs into runs that are consecutive on both sides: one transfer
descriptor (or one contiguous byte range) per run instead of one per block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BlockRun(NamedTuple):
    """Blocks `remote_start .. remote_start + length - 1` go to `local_start ..` in order."""

    remote_start: int
    local_start: int
    length: int


def merge_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """Split the pairs `(remote_block_ids[i], local_block_ids[i])` into maximal runs, in order.

    A run grows while both ids are one past the previous pair's; the runs, expanded, are the
    pairs again in the same order.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(
            f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local ones: "
            "a pull plan pairs them one to one"
        )
    runs: list[BlockRun] = []
    for remote, local in zip(remote_block_ids, local_block_ids, strict=True):
        if runs:
            last = runs[-1]
            if (
                remote == last.remote_start + last.length
                and local == last.local_start + last.length
            ):
                runs[-1] = last._replace(length=last.length + 1)
                continue
        runs.append(BlockRun(remote, local, 1))
    return runs
