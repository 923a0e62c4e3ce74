"""ByteBudget: a byte-weighted, FIFO-fair async semaphore.

Runs on the background loop thread only (not thread-safe). A request is granted when
every earlier request has been granted and enough bytes are free, so a large request is
never starved by a stream of small ones. A request larger than the whole budget is a bug
in the caller (plans chunk to fit) and raises at once instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["ByteBudget"]


class ByteBudget:
    """At most ``capacity`` bytes reserved at any time; tracks the high-water mark."""

    def __init__(self, capacity: int, name: str = "budget") -> None:
        if capacity <= 0:
            raise ValueError(f"{name}: capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.name = name
        self._used = 0
        self.high_water = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        return self._used

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` can be reserved, then reserve them (FIFO order)."""
        if nbytes < 0:
            raise ValueError(f"{self.name}: cannot reserve a negative amount ({nbytes})")
        if nbytes > self.capacity:
            raise ValueError(f"{self.name}: request of {nbytes} bytes exceeds the whole budget of {self.capacity}")
        if not self._waiters and self._used + nbytes <= self.capacity:
            self._grant(nbytes)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiters.append(entry)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(nbytes)  # granted just as we were cancelled: give it back
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()
            raise

    def try_acquire(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` now if that needs no waiting (and nobody waits before us)."""
        if nbytes < 0:
            raise ValueError(f"{self.name}: cannot reserve a negative amount ({nbytes})")
        if self._waiters or self._used + nbytes > self.capacity:
            return False
        self._grant(nbytes)
        return True

    def release(self, nbytes: int) -> None:
        """Give back bytes reserved by :meth:`acquire`."""
        if nbytes > self._used:
            raise RuntimeError(f"{self.name}: releasing {nbytes} bytes but only {self._used} held")
        self._used -= nbytes
        self._wake()

    @asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        """``async with budget.reserve(n):`` holds n bytes for the block, released in finally."""
        await self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)

    def _grant(self, nbytes: int) -> None:
        self._used += nbytes
        self.high_water = max(self.high_water, self._used)

    def _wake(self) -> None:
        while self._waiters:
            nbytes, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if self._used + nbytes > self.capacity:
                return
            self._waiters.popleft()
            self._grant(nbytes)
            future.set_result(None)
