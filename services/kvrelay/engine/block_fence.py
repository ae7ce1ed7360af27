"""The scheduler's guard on freed blocks under async scheduling (engine/async_step.py)."""

from __future__ import annotations

from typing import Protocol

from kvrelay.engine.request import Request


class BlockFence(Protocol):
    """Async scheduling's guard on freed blocks (engine/async_step.py): a block a launched
    step still reads or writes never goes back to the pool before that step is done."""

    def in_use(self, request: Request) -> bool:
        """Whether a launched, unfinished step uses `request`'s blocks."""
        ...

    def hold(self, request: Request, blocks: list[int]) -> None:
        """Free `blocks` (released from `request`) once its last launched step is done."""
        ...

    def wait(self) -> None:
        """Wait until every launched step's device work is done; free what was held."""
        ...
