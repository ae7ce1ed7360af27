"""An approximate index of which worker holds which prefix-cache blocks.

Fed two ways, as llm-d's precise and approximate prefix scorers are: workers report the chain
hashes of the blocks they cache (a periodic refresh replaces a worker's set), and the router
records the blocks of each prompt it sends, since the worker will cache them in a moment.
Chain hashes make a match position-aware: a prompt's i-th block hash can only be present if
its whole prefix up to block i is the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int = 1 << 18) -> None:
        self._blocks: dict[str, set[bytes]] = {}
        self._max_blocks = max_blocks_per_worker

    def replace(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """A worker's own report: the full set of blocks it caches now."""
        self._blocks[worker_id] = set(hashes)

    def record(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """The router sent a prompt with these block hashes to `worker_id`."""
        blocks = self._blocks.setdefault(worker_id, set())
        if len(blocks) + len(hashes) > self._max_blocks:
            blocks.clear()  # a crude bound; the next report restores the truth
        blocks.update(hashes)

    def remove(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def matched_blocks(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt `worker_id` probably holds."""
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        matched = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            matched += 1
        return matched
