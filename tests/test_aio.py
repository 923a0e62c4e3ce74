"""asyncio helpers shared by every stage (aiosnap/core/aio.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiosnap.core.aio import complete_before_cancel, run_detached


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


async def test_run_detached_runs_blocking_calls_on_its_own_thread_that_nothing_waits_for() -> None:
    """The trainer's look at a root (issue 25 review): its blocking calls run on a daemon
    thread of its own, never in the loop's default executor (whose threads the loop's
    closing and the interpreter's exit wait for); its result and its errors come back; a
    look given up on leaves the stuck thread behind, waiting for nobody."""
    loop_thread = threading.current_thread()
    seen: list[threading.Thread] = []

    async def look() -> int:
        await asyncio.to_thread(lambda: seen.append(threading.current_thread()))
        return 7

    assert await asyncio.wait_for(run_detached(look, "test-look"), 10) == 7
    assert seen[0] is not loop_thread and seen[0].name == "test-look" and seen[0].daemon

    async def fails() -> None:
        await asyncio.to_thread(lambda: (_ for _ in ()).throw(PermissionError("denied")))

    with pytest.raises(PermissionError, match="denied"):
        await asyncio.wait_for(run_detached(fails, "test-look"), 10)

    release = threading.Event()

    async def stuck() -> None:
        await asyncio.to_thread(release.wait, 30)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(run_detached(stuck, "test-stuck"), 0.2)
    (thread,) = [t for t in threading.enumerate() if t.name == "test-stuck"]
    assert thread.daemon and thread.is_alive()
    release.set()
    thread.join(10)
    assert not thread.is_alive()
