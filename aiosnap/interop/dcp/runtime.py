"""What aiosnap's DCP writers and readers of one process share: a background event loop,
the storage backends (one per root and configuration, so an S3 client is made once), and
staging slabs of the RAM budget (allocated once, reused by every save).

DCP calls its storage layer synchronously, from the trainer's thread (``dcp.save``), from
its checkpoint thread (``async_save``, THREAD) or from its checkpoint process (PROCESS).
Those calls hand coroutines to the loop thread here (:meth:`Runtime.run`) and block for
them. A process made with ``fork`` gets a runtime of its own (the loop thread does not
cross a fork); it is all closed when the interpreter exits.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ...config import Config
from ...core.arena import Arena, SlabLease
from ...core.loop import LoopThread
from ...storage.base import Storage
from ...storage.registry import storage_from_url

__all__ = ["Runtime", "SlabPool", "runtime", "slab_bytes_for"]

T = TypeVar("T")
_MAX_STORAGES = 16
_ALIGN = 64


def slab_bytes_for(config: Config, ram_budget: int) -> int:
    """A slab: ``upload.chunk_size``, at most a quarter of the RAM budget (so that staging
    and uploads overlap), a multiple of 64 (as the checkpointer's own slabs)."""
    size = min(config.upload.chunk_size, ram_budget // 4)
    return max(_ALIGN, size // _ALIGN * _ALIGN)


class SlabPool:
    """``count`` slabs of ``slab_bytes`` in one arena, lent one at a time (loop thread for
    :meth:`acquire`; any thread for :meth:`release`). The most recently returned slab is
    lent first, so a small checkpoint touches few pages. A slab whose bytes an abandoned
    request may still read (see :class:`~aiosnap.core.arena.SlabLease`) is not lent again
    until nothing reads it."""

    def __init__(self, slab_bytes: int, count: int, loop: asyncio.AbstractEventLoop) -> None:
        self.slab_bytes = slab_bytes
        self.count = count
        self.arena = Arena(slab_bytes, count, shared=False)
        self._free = list(range(count))
        self._held: list[tuple[int, SlabLease]] = []
        self._loop = loop
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> int:
        """A free slab's id, waiting until one comes back when all are lent."""
        while True:
            self._reclaim()
            if self._free:
                return self._free.pop()
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._waiters.append(waiter)
            try:  # held slabs are looked at again now and then: nothing wakes us for them
                await asyncio.wait_for(waiter, 0.5 if self._held else None)
            except TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def view(self, slab: int, nbytes: int | None = None) -> memoryview:
        return self.arena.view(slab, nbytes)

    def lease(self, slab: int, nbytes: int) -> SlabLease:
        return self.arena.lease(slab, nbytes)

    def release(self, slab: int, lease: SlabLease | None = None) -> None:
        """Give ``slab`` back (after its write; ``lease``, if it was lent to a request)."""
        self._loop.call_soon_threadsafe(self._back, slab, lease)

    def _back(self, slab: int, lease: SlabLease | None) -> None:
        if lease is not None:
            lease.release()
            if lease.in_use:
                self._held.append((slab, lease))
                return
        self._free.append(slab)
        self._wake()

    def _reclaim(self) -> None:
        still = []
        for slab, lease in self._held:
            if lease.in_use:
                still.append((slab, lease))
            else:
                self._free.append(slab)
        self._held = still

    def _wake(self) -> None:
        while self._waiters and self._free:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Runtime:
    """The shared loop, storages and slab pools of this process (see the module)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = LoopThread(name="aiosnap-dcp")
        self._lock = threading.Lock()
        self._storages: collections.OrderedDict[tuple[str, str], Storage] = collections.OrderedDict()
        self._pools: dict[tuple[int, int], SlabPool] = {}

    def run(self, coro: Coroutine[Any, Any, T], *, abandoned: Callable[[T], None] | None = None) -> T:
        """Run ``coro`` on the loop; block this thread for its result (a result that comes
        when this thread has given up -- a KeyboardInterrupt -- goes to ``abandoned``)."""
        return self.loop.run(coro, abandoned=abandoned)

    def storage(self, url: str, config: Config) -> Storage:
        """The backend of ``url`` under ``config`` (made once, kept for later saves)."""
        key = (url, config.model_dump_json())
        with self._lock:
            found = self._storages.get(key)
            if found is not None:
                self._storages.move_to_end(key)
                return found
            found = self._storages[key] = storage_from_url(url, config)
            while len(self._storages) > _MAX_STORAGES:
                _, old = self._storages.popitem(last=False)
                self.loop.submit(old.close())
            return found

    def pool(self, config: Config) -> SlabPool:
        """The staging slabs for ``config``'s RAM budget and chunk size."""
        budget = config.ram_budget_bytes()
        slab = slab_bytes_for(config, budget)
        key = (slab, max(1, budget // slab))
        with self._lock:
            found = self._pools.get(key)
            if found is None:
                found = self._pools[key] = SlabPool(slab, key[1], self.loop.loop)
            return found

    def close(self) -> None:
        async def close_all() -> None:
            for storage in list(self._storages.values()):
                with contextlib.suppress(Exception):  # closing at exit: nothing to report to
                    await storage.close()

        if self.loop.forked():
            return
        try:
            self.loop.run(close_all())
        finally:
            self.loop.stop()
            for pool in self._pools.values():
                pool.arena.close()


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime (made on first use; a new one in a forked child)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None or _RUNTIME.pid != os.getpid():
            _RUNTIME = Runtime()
            atexit.register(_RUNTIME.close)
        return _RUNTIME
