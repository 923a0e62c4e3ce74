"""Staging slabs on the trainer side: the arena's slabs as torch tensors, lent out one at a
time under the RAM budget.

A slab is lent to capture, filled, handed to the transfer side as a descriptor (its id),
and comes back when the transfer side is done with it (landed or dropped). Lending is
FIFO-fair: a save waiting for RAM is served in order. The lowest free slab goes first, so
the slabs ever written (the arena's resident part) are as many as were lent at once.
Loop thread only (the copier thread writes into a slab it was lent), except
:meth:`SlabPool.ready`.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import threading

import torch

from ..core.arena import Arena
from ..core.budget import ByteBudget

__all__ = ["LoadSlabs", "SlabPool"]

log = logging.getLogger("aiosnap")


class SlabPool:
    """The slabs of ``arena``; ``budget`` counts the bytes lent out (its high-water mark is
    the staging RAM a save really used)."""

    def __init__(self, arena: Arena, budget: ByteBudget) -> None:
        self.arena = arena
        self.budget = budget
        self.slab_bytes = arena.slab_bytes
        self._base = torch.frombuffer(arena.buffer, dtype=torch.uint8)
        self._free: asyncio.PriorityQueue[int] = asyncio.PriorityQueue()  # the lowest slab first
        for slab in range(arena.count):
            self._free.put_nowait(slab)
        self._held: dict[int, int] = {}
        self._released_while_held: set[int] = set()
        self._pinned = False
        self._pin_lock = threading.Lock()
        self._pinned_to = 0  # bytes of the arena registered with CUDA, from its start
        self._registered: list[int] = []  # addresses of the registered extents
        self._pin_failed = False

    def tensor(self, slab: int) -> torch.Tensor:
        """Slab ``slab`` as a uint8 tensor over the arena (no copy)."""
        start = slab * self.slab_bytes
        return self._base[start : start + self.slab_bytes]

    def would_wait(self) -> bool:
        """True when :meth:`acquire` cannot be served at once."""
        return self._free.empty()

    async def acquire(self) -> int:
        """A free slab's id, waiting (FIFO) until one comes back when all are lent."""
        slab = await self._free.get()
        self._count_out()
        return slab

    def try_acquire(self) -> int | None:
        """A free slab's id now, or None."""
        if self._free.empty():
            return None
        slab = self._free.get_nowait()
        self._count_out()
        return slab

    def release(self, slab: int) -> None:
        """A lent slab comes back (the transfer side is done with it); while :meth:`hold`
        keeps it, it comes back when the last hold ends."""
        if slab in self._held:
            self._released_while_held.add(slab)
            return
        self.budget.release(self.slab_bytes)
        self._free.put_nowait(slab)

    def hold(self, slab: int) -> None:
        """Keep the lent slab ``slab`` from being lent again, even once released, until
        :meth:`unhold` (a reader of its bytes other than the transfer side: the spool
        securing a chunk on preemption)."""
        self._held[slab] = self._held.get(slab, 0) + 1

    def unhold(self, slab: int) -> None:
        left = self._held[slab] - 1
        if left:
            self._held[slab] = left
            return
        del self._held[slab]
        if slab in self._released_while_held:
            self._released_while_held.discard(slab)
            self.release(slab)

    def _count_out(self) -> None:
        if not self.budget.try_acquire(self.slab_bytes):
            raise AssertionError("the RAM budget cannot be short of a free slab: it is the arena's size")

    def pin(self) -> None:
        """From now on, slabs are page-locked with CUDA (registered) before they are
        written, so device copies into them run asynchronously on a copy stream; asked when
        a save first holds CUDA tensors. Only the part of the arena in use is registered
        (registering makes pages resident): see :meth:`ready`."""
        if torch.cuda.is_available():
            self._pinned = True

    def needs_ready(self, slab: int) -> bool:
        """True when :meth:`ready` has work to do for ``slab`` (any thread)."""
        return self._pinned and not self._pin_failed and self._pinned_to < self._end_of(slab)

    def ready(self, slab: int) -> None:
        """Make slab ``slab`` ready to be written by device copies: once the pool is
        pinned, register with CUDA the arena from what is registered so far up to the end
        of this slab (one extent; the slabs below were lent before it, lowest first).
        Blocking (registration faults the pages in); called by the thread about to write
        the slab (the copier's, a load's worker); thread-safe, cheap when there is nothing
        to do."""
        if not self.needs_ready(slab):
            return
        with self._pin_lock:
            end = self._end_of(slab)
            if self._pin_failed or self._pinned_to >= end:
                return
            address = self._base.data_ptr() + self._pinned_to
            result = torch.cuda.cudart().cudaHostRegister(address, end - self._pinned_to, 0)  # type: ignore[no-untyped-call]
            if int(result) != 0:
                self._pin_failed = True
                log.warning("aiosnap: cannot pin the staging arena (cudaHostRegister: %s); device copies block", result)
                return
            self._registered.append(address)
            self._pinned_to = end

    def ready_for(self, buffer: torch.Tensor) -> None:
        """:meth:`ready` for the slab that ``buffer`` (a slab's tensor, or part of one) is in."""
        self.ready((buffer.data_ptr() - self._base.data_ptr()) // self.slab_bytes)

    def _end_of(self, slab: int) -> int:
        """The end of ``slab`` in the arena, rounded up to a page (registration works by
        pages; the mapping itself is whole pages)."""
        end = (slab + 1) * self.slab_bytes
        return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE

    def close(self) -> None:
        """Unpin; the arena itself is closed by its owner."""
        with self._pin_lock:
            for address in self._registered:
                torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
            self._registered.clear()
            self._pinned_to = 0


class LoadSlabs:
    """Slabs of ``pool`` lent to a load that stages its copies
    (:class:`aiosnap.load.staged.StagingSlabs`): the same RAM budget as saves, served in
    the same FIFO order. Loop thread."""

    def __init__(self, pool: SlabPool) -> None:
        self._pool = pool
        self.slab_bytes = pool.slab_bytes

    async def acquire(self) -> tuple[int, torch.Tensor]:
        slab = await self._pool.acquire()
        if self._pool.needs_ready(slab):  # (pinned: registering faults its pages in)
            try:
                await asyncio.to_thread(self._pool.ready, slab)
            except BaseException:
                self._pool.release(slab)
                raise
        return slab, self._pool.tensor(slab)

    def release(self, slab: int) -> None:
        self._pool.release(slab)
