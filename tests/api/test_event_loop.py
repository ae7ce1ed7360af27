"""The router process's event loop (api/platform.py run_event_loop): uvloop where installed,
and the coroutine's result and errors come through as under asyncio.run."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kvrelay.api.platform import run_event_loop


def test_the_router_runs_on_uvloop() -> None:
    seen: list[type] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()))

    run_event_loop(main())
    assert seen == [uvloop.Loop]


def test_an_error_in_the_router_reaches_the_caller() -> None:
    async def main() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad flag")

    with pytest.raises(ValueError, match="bad flag"):
        run_event_loop(main())
    # The loop was closed on the way out: the next run gets a fresh one.
    run_event_loop(asyncio.sleep(0))
