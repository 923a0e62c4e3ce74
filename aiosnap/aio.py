"""asyncio helpers shared by every stage (run on whichever loop calls them)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["complete_before_cancel"]

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
