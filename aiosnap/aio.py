"""asyncio helpers shared by every stage (run on whichever loop calls them)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["complete_before_cancel", "finish_despite_cancel"]

T = TypeVar("T")


async def complete_before_cancel(operation: Coroutine[Any, Any, T]) -> T:
    """Await ``operation``; if the caller is cancelled meanwhile, let the operation run to
    its end first (no buffer still in use by a thread, no file left open), then re-raise."""
    task = asyncio.ensure_future(operation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # mark retrieved: the cancellation is what the caller reports
        raise


async def finish_despite_cancel(operation: Coroutine[Any, Any, T]) -> T:
    """Await ``operation`` to its end and return its result, however often the caller is
    cancelled meanwhile (the cancellations are absorbed: use it where an outcome must be
    reported whatever happens, such as settling a failed save)."""
    task = asyncio.ensure_future(operation)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # absorbed: nothing above is told to stop
            if task.done():
                return task.result()
