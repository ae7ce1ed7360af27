"""until_disconnected (api/disconnect.py): a client that leaves cancels the work and ends with
ClientGoneError, quietly — never InvalidStateError from asking a just-cancelled task for its
result; work that finishes first returns its result or raises its own error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from kvrelay.api.disconnect import ClientGoneError, until_disconnected


def request_whose_client(leaves_after_s: float | None) -> Request:
    async def receive() -> dict[str, Any]:
        if leaves_after_s is None:
            await asyncio.Event().wait()  # never leaves
        await asyncio.sleep(leaves_after_s or 0)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def test_a_client_that_leaves_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # cleanup that takes a moment (an abort at a worker)
            cancelled.set()
            raise
        return "late"

    with pytest.raises(ClientGoneError):
        await until_disconnected(request_whose_client(0.0), work())
    assert cancelled.is_set()


async def test_work_that_finishes_first_gives_its_result_or_its_error() -> None:
    async def answer() -> int:
        return 42

    async def fail() -> int:
        raise ValueError("bad")

    assert await until_disconnected(request_whose_client(None), answer()) == 42
    with pytest.raises(ValueError, match="bad"):
        await until_disconnected(request_whose_client(None), fail())
