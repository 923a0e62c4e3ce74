"""Staging slabs on the trainer side: the arena's slabs as torch tensors, lent out one at a
time under the RAM budget.

A slab is lent to capture, filled, handed to the transfer side as a descriptor (its id),
and comes back when the transfer side is done with it (landed or dropped). Lending is
FIFO-fair: a save waiting for RAM is served in order. Loop thread only (the copier thread
writes into a slab it was lent).
"""

from __future__ import annotations

import asyncio
import logging

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
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slab in range(arena.count):
            self._free.put_nowait(slab)
        self._pinned = False

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
        """A lent slab comes back (the transfer side is done with it)."""
        self.budget.release(self.slab_bytes)
        self._free.put_nowait(slab)

    def _count_out(self) -> None:
        if not self.budget.try_acquire(self.slab_bytes):
            raise AssertionError("the RAM budget cannot be short of a free slab: it is the arena's size")

    def pin(self) -> None:
        """Register the arena with CUDA (page-locked) so device copies into it run
        asynchronously on a copy stream; once, when a save first holds CUDA tensors."""
        if self._pinned or not torch.cuda.is_available():
            return
        result = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            self._base.data_ptr(), self.arena.size, 0
        )
        if int(result) != 0:
            log.warning("aiosnap: could not pin the staging arena (cudaHostRegister: %s); device copies block", result)
            return
        self._pinned = True

    def close(self) -> None:
        """Unpin; the arena itself is closed by its owner."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())  # type: ignore[no-untyped-call]
            self._pinned = False


class LoadSlabs:
    """Slabs of ``pool`` lent to a load that stages its copies
    (:class:`aiosnap.load.staged.StagingSlabs`): the same RAM budget as saves, served in
    the same FIFO order. Loop thread."""

    def __init__(self, pool: SlabPool) -> None:
        self._pool = pool
        self.slab_bytes = pool.slab_bytes

    async def acquire(self) -> tuple[int, torch.Tensor]:
        slab = await self._pool.acquire()
        return slab, self._pool.tensor(slab)

    def release(self, slab: int) -> None:
        self._pool.release(slab)
