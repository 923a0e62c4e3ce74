"""asyncio helpers shared by every stage (aiosnap/core/aio.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiosnap.core.aio import complete_before_cancel


async def test_complete_before_cancel_outlasts_every_cancellation() -> None:
    """A second cancellation (the save's task, then its capture) gave up waiting and left
    the worker thread running: it then wrote a journal into the folder the abort had just
    removed, and the next start committed the save its caller saw cancelled."""
    release, finished = threading.Event(), threading.Event()

    def work() -> str:
        release.wait(10)
        finished.set()
        return "done"

    task = asyncio.ensure_future(complete_before_cancel(asyncio.to_thread(work)))
    await asyncio.sleep(0)
    for _ in range(3):  # cancelled again and again while it waits for the thread
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done(), "gave up on a thread that is still running"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()


async def test_complete_before_cancel_returns_and_raises_as_the_operation_does() -> None:
    async def fails() -> None:
        raise OSError("disk")

    assert await complete_before_cancel(asyncio.to_thread(lambda: 3)) == 3
    with pytest.raises(OSError, match="disk"):
        await complete_before_cancel(fails())
