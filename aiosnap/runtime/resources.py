"""The engine's staging resources: the arena and its RAM budget, the slab pool, the bounce
slab of an overflow spool, and the copier with its thread.

:class:`Resources` is made on the caller's thread as a checkpointer starts (the arena is
reserved then; it becomes resident where it is written); everything else runs on aiosnap's
loop thread, except the copies themselves, which run on the copier's own thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from ..config import Config
from ..core.arena import Arena
from ..core.budget import ByteBudget
from ..handoff.spooldir import Spool
from ..load.fetch import ReadPlan
from ..trainer.capture import Copier
from ..trainer.chunks import ALIGN
from ..trainer.slabs import LoadSlabs, SlabPool
from ..trainer.spool import Bounce

__all__ = ["Resources", "scratch_slabs_for", "slab_bytes_for"]

log = logging.getLogger("aiosnap")


def slab_bytes_for(config: Config, ram_budget: int) -> int:
    """Chunk (and staging slab) size: ``upload.chunk_size``, at most a quarter of the RAM
    budget so capture and upload overlap, a multiple of the alignment."""
    size = min(config.upload.chunk_size, ram_budget // 4)
    return max(ALIGN, size // ALIGN * ALIGN)


def scratch_slabs_for(config: Config, count: int) -> int:
    """Slabs of the RAM budget (``count`` in all) set aside for the transfer side to pack
    incremental or compressed chunks into (it never writes a slab: see
    :mod:`aiosnap.transfer.dedup`), none with fewer than four slabs (chunks then land
    whole). With compression every chunk is packed: room for ``upload.concurrency`` chunks
    at once with their codec scratch, at most half the budget. With dedup alone only the
    new pieces of a chunk that also reuses some are packed (a chunk with nothing reused
    uploads from its slab; one with nothing new writes no object): an eighth of the budget
    (at least one slab), so that the capture keeps most of it."""
    compress = config.upload.compression != "none"
    if not (config.upload.dedup or compress) or count < 4:
        return 0
    return min(config.upload.concurrency + 1, count // 2 if compress else max(1, count // 8))


class Resources:
    """The arena (shared with the upload process in ``process`` mode), its budget, the
    slabs lent from it, and the copier that fills them."""

    def __init__(self, config: Config, ram_budget: int, spool: Spool | None) -> None:
        self.spool = spool
        self.slab_bytes = slab_bytes_for(config, ram_budget)
        count = max(1, ram_budget // self.slab_bytes)
        scratch = scratch_slabs_for(config, count)
        self.scratch_bytes = scratch * self.slab_bytes
        """The share of the budget the transfer side packs chunks in (outside the arena)."""
        count -= scratch
        shared = config.upload.executor == "process"
        self.arena = Arena(self.slab_bytes, count, shared=shared)  # reserved; resident where written
        self.budget = ByteBudget(self.arena.size, "ram_budget")
        self.pool: SlabPool | None = None  # made on the loop (it holds an asyncio queue)
        self.bounce: Bounce | None = None
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiosnap-copier")
        self.copier = Copier()

    async def warm_up(self) -> None:
        """Warm the copier up on its thread (its first copy would pay for it); loop thread."""
        await asyncio.get_running_loop().run_in_executor(self.executor, self.copier.warm_up)

    def slab_pool(self) -> SlabPool:
        """The staging slabs (made on first use)."""
        if self.pool is None:
            self.pool = SlabPool(self.arena, self.budget)
            if self.spool is not None and self.spool.mode == "overflow":
                if self.arena.count < 2:
                    log.warning("aiosnap: the RAM budget holds one slab: no bounce slab, spooling is off")
                else:  # one slab of the budget is set aside to spill through when the rest is lent
                    self.bounce = Bounce(self.pool)
        return self.pool

    def load_slabs(self, plan: ReadPlan) -> LoadSlabs:
        """The staging slabs a load borrows (from the saves' pool, under the same RAM
        budget; pinned when it copies into CUDA tensors) for what it cannot read straight
        into its destination."""
        pool = self.slab_pool()
        targets = [*plan.staged.values(), *(t.dest for boxes in plan.shards.values() for t in boxes)]
        if any(t.device.type == "cuda" for t in targets):
            pool.pin()
        return LoadSlabs(pool)

    def close_pool(self) -> None:
        """Unpin and close the slab pool (after the transfer side is closed)."""
        if self.pool is not None:
            self.pool.close()

    def stop_copier(self) -> None:
        """Wait for the copier's thread to end."""
        self.executor.shutdown(wait=True)

    def free(self) -> None:
        """Drop the pool and unmap the arena (last)."""
        self.pool = None
        self.arena.close()
