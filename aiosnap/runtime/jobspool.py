"""The spool side of one save: its :class:`~aiosnap.trainer.spool.SpoolSession` (when the
engine has a spool) and the background writes the end of the save waits for.

Those writes are spool and journal writes (a chunk landed, a chunk kept on the spool under
preemption, the journal made resumable), and, when an upload process died, the read-back
of the save's commit or the markers the other ranks of a multi-rank save need. Loop thread
only; the session's file writes run on its own threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from ..format.placement import Landing
from ..handoff.contract import SlabChunk
from ..storage.base import Storage
from ..trainer.chunks import SavePlan
from ..trainer.spool import SpoolSession
from .resources import Resources

__all__ = ["JobSpool"]

log = logging.getLogger("aiosnap")


class JobSpool:
    """The spool session and the pending side writes of the save of ``plan`` (loop thread)."""

    def __init__(self, plan: SavePlan, resources: Resources) -> None:
        self.plan = plan
        self.resources = resources
        self.session: SpoolSession | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def open(self, storage: Storage, owner_url: str, keep_last: int | None) -> SpoolSession | None:
        """Start the save's spool session (none without a spool), as its capture starts."""
        resources = self.resources
        if resources.spool is not None and resources.pool is not None:
            self.session = SpoolSession(
                resources.spool, self.plan, storage.url, owner_url, resources.pool, resources.bounce, keep_last
            )
        return self.session

    def run(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task the end of the save waits for."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def keep_resumable(self) -> None:
        """Preempted: journal the save whatever it holds in RAM (see SpoolSession.keep_resumable)."""
        if self.session is not None and self.plan.spec.distributed is None:
            self.run(self.session.keep_resumable())

    def secure(self, chunk: SlabChunk, on_spool: Callable[[int], None]) -> None:
        """Write ``chunk`` (in RAM) to the save's spool folder, holding its slab meanwhile;
        ``on_spool(payload)`` hears when it is there."""
        session, pool = self.session, self.resources.pool
        if session is None or pool is None or self.plan.spec.distributed is not None:
            return
        pool.hold(chunk.slab)
        arena, planned = self.resources.arena, self.plan.chunks[chunk.index]

        async def write() -> None:
            try:
                if await session.secure(planned, arena.view(chunk.slab, chunk.nbytes)):
                    on_spool(planned.payload)
            except Exception as exc:  # the save itself goes on
                log.warning("aiosnap: keeping chunk %d of step %d on the spool: %r", chunk.index, self.plan.step, exc)
            finally:
                pool.unhold(chunk.slab)

        self.run(write())

    def done_with(self, index: int, pieces: Landing | None) -> None:
        """Journal that chunk ``index`` landed (``pieces``) or will not be uploaded (None)."""
        if self.session is not None:
            self.run(self.session.done_with(index, pieces))

    async def finish(self) -> None:
        """Wait for the side writes, then end the session (its folder goes or stays)."""
        if self.tasks:
            await asyncio.wait(set(self.tasks))
        if self.session is not None:
            await self.session.finish()
