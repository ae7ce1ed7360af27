"""merge_runs: runs cover exactly the pairs, in order, and are maximal."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.transfer.runs import BlockRun, merge_runs


def expand(runs: list[BlockRun]) -> list[tuple[int, int]]:
    return [(r.remote_start + i, r.local_start + i) for r in runs for i in range(r.length)]


def test_examples() -> None:
    assert merge_runs([], []) == []
    assert merge_runs([5, 6, 7], [0, 1, 2]) == [BlockRun(5, 0, 3)]
    # consecutive on one side only: no merge
    assert merge_runs([5, 6, 7], [0, 2, 3]) == [BlockRun(5, 0, 1), BlockRun(6, 2, 2)]
    assert merge_runs([3, 4, 9, 10, 2], [7, 8, 9, 10, 0]) == [
        BlockRun(3, 7, 2),
        BlockRun(9, 9, 2),
        BlockRun(2, 0, 1),
    ]
    # going down is not a run
    assert merge_runs([2, 1], [2, 1]) == [BlockRun(2, 2, 1), BlockRun(1, 1, 1)]


def test_length_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="one to one"):
        merge_runs([1, 2], [1])


# Small id ranges make consecutive pairs (and so merges) frequent.
pairs = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=40)


@given(pairs)
def test_runs_cover_the_pairs_in_order_and_are_maximal(items: list[tuple[int, int]]) -> None:
    remote = [r for r, _ in items]
    local = [lo for _, lo in items]
    runs = merge_runs(remote, local)
    assert expand(runs) == items
    assert all(r.length >= 1 for r in runs)
    for before, after in itertools.pairwise(runs):
        # a maximal run could not have absorbed the next one's first pair
        assert not (
            after.remote_start == before.remote_start + before.length
            and after.local_start == before.local_start + before.length
        )
