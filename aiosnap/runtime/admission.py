"""Which saves may start, and the saves in flight: the pending-save slots (backpressure),
the step order, the failure ledger and the drain.

:class:`Admission` holds the engine's table of saves in flight (by save id) and the
progress board a live display reads. A save takes a slot before it is made, keeps it until
its task has ended, and is refused while an earlier save of the same or a later step to
the same root is in flight. A multi-rank save beats (a heartbeat in storage) while it waits
for its slot, so that the other ranks do not take this rank for stopped. Loop thread only
(the failure ledger excepted, see :mod:`aiosnap.core.failures`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from ..config import Config
from ..core.aio import finish_despite_cancel
from ..core.failures import FailureLedger
from ..core.names import attempt_prefix, step_dir
from ..core.progress import ProgressBoard
from ..errors import StepOrderError
from ..storage.base import Storage
from ..trainer.chunks import SavePlan
from ..transfer.heartbeat import Heartbeat
from ..transfer.rank_settle import abandon_part
from .savejob import SaveJob

__all__ = ["Admission"]

log = logging.getLogger("aiosnap")


class Admission:
    """The saves in flight of one engine and what lets a new one in (loop thread)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.failures = FailureLedger()
        self.jobs: dict[str, SaveJob] = {}  # save id -> the save in flight
        self.board = ProgressBoard()
        """The progress of the saves in flight (a live display reads it)."""
        self._pending: asyncio.Semaphore | None = None
        self._told_over_budget = False
        self._holds: dict[str, asyncio.Event] = {}  # root url -> set when its hold ends

    @contextlib.asynccontextmanager
    async def hold(self, storage: Storage) -> AsyncIterator[None]:
        """Admit no new save to the root of ``storage`` meanwhile (one hold at a time per
        root): what a rollback, a purge or a spool resume commits or deletes must not race a
        save's base (an incremental save names only objects of the newest committed step)."""
        url = storage.url
        while (other := self._holds.get(url)) is not None:
            await other.wait()
        ended = asyncio.Event()
        self._holds[url] = ended
        try:
            yield
        finally:
            del self._holds[url]
            ended.set()

    async def _unheld(self, storage: Storage) -> None:
        while (held := self._holds.get(storage.url)) is not None:
            await held.wait()

    def raise_unobserved(self) -> None:
        """Raise the oldest background failure nobody has been told about (once)."""
        failure = self.failures.take()
        if failure is not None:
            raise failure

    def check_order(self, step: int, storage: Storage) -> None:
        """Refuse a step at or below one this engine is saving to the same root."""
        for job in self.jobs.values():
            if job.storage.url == storage.url and job.plan.step >= step and not job.aborted:
                what = "already being saved" if job.plan.step == step else f"older than step {job.plan.step}"
                raise StepOrderError(
                    f"step {step} is {what}, whose save to {storage.url} is still in flight: "
                    "steps only move forward; wait for that save's handle first"
                )

    def say_if_over_budget(self, plan: SavePlan, ram_budget: int, spooling: bool) -> None:
        """Once per engine: a state larger than the RAM budget, with no spool to spill to,
        makes save() wait for uploads (said through logging at WARNING, which Python shows
        on stderr even when logging is not set up)."""
        if self._told_over_budget or spooling or plan.total_bytes <= ram_budget:
            return
        self._told_over_budget = True
        over = plan.total_bytes - ram_budget
        log.warning(
            "aiosnap: the state of step %d (%.1f MiB) is larger than the RAM budget (%.1f MiB) and no spool is "
            "configured: save() returns only once %.1f MiB have reached storage. Raise ram_budget, or set "
            "spool.dir to spill to local disk and return at disk speed (said once).",
            plan.step, plan.total_bytes / 2**20, ram_budget / 2**20, over / 2**20,
        )  # fmt: skip

    async def enter(self, plan: SavePlan, storage: Storage) -> Heartbeat | None:
        """Wait for a pending-save slot for ``plan`` (checked before and after the wait:
        an unobserved failure, the step order); returns the heartbeat of a multi-rank save,
        which beats until its transfer side takes over (see :meth:`withdraw`)."""
        if self._pending is None:
            self._pending = asyncio.Semaphore(self.config.max_pending_saves)
        bridge = self._bridge(plan, storage)
        try:
            while True:  # a rollback, purge or spool resume of this root holds it: wait, slot or not
                await self._unheld(storage)
                await self._pending.acquire()
                if storage.url not in self._holds:
                    break
                self._pending.release()  # held while we waited for the slot: let the hold finish
        except BaseException:
            await self.drop_bridge(bridge, storage, plan)
            raise
        try:
            self.raise_unobserved()  # a save that failed while we waited
            self.check_order(plan.step, storage)
        except BaseException:
            self._pending.release()
            await self.drop_bridge(bridge, storage, plan)
            raise
        return bridge

    async def withdraw(self, bridge: Heartbeat | None, storage: Storage, plan: SavePlan) -> None:
        """A save that took its slot never began: free the slot and its heartbeat."""
        assert self._pending is not None
        self.jobs.pop(plan.save_id, None)
        self._pending.release()
        await self.drop_bridge(bridge, storage, plan)

    def add(self, job: SaveJob) -> None:
        """``job`` (holding a slot) is in flight."""
        self.board.add(job.progress)
        self.jobs[job.plan.save_id] = job

    def forget(self, job: SaveJob) -> None:
        """Done callback of a save's task, however it ended (cancelled before its first
        step included): free its slot and its name, and settle whatever is not settled."""
        assert self._pending is not None
        self.jobs.pop(job.plan.save_id, None)
        self._pending.release()
        self.board.discard(job.progress)
        job.settle()

    def _bridge(self, plan: SavePlan, storage: Storage) -> Heartbeat | None:
        """A multi-rank save's heartbeat from the trainer side, while it waits for a
        pending-save slot and until its transfer side (maybe an upload process still
        starting) beats: the other ranks, perhaps one save further, must not take this rank
        for stopped meanwhile."""
        if plan.spec.distributed is None:
            return None
        bridge = Heartbeat(storage, plan.spec, self.config.distributed)
        bridge.start()
        return bridge

    @staticmethod
    async def drop_bridge(bridge: Heartbeat | None, storage: Storage, plan: SavePlan) -> None:
        """A save that never began: no heartbeat, and no empty folder, left behind."""
        if bridge is None:
            return
        await finish_despite_cancel(bridge.stop())
        try:
            await storage.remove_empty_folder(attempt_prefix(plan.step, plan.save_id))
            await storage.remove_empty_folder(step_dir(plan.step))
        except Exception as exc:
            log.debug("aiosnap: removing the folder of a save that never began failed: %r", exc)

    @staticmethod
    async def leave(plan: SavePlan, storage: Storage, error: BaseException) -> None:
        """``save()`` of a multi-rank ``plan`` failed on this rank after the ranks agreed.
        If the transfer side never took the save over, tell the other ranks through storage
        (the coordinator gives up; another rank reports that its part will not come), so
        they fail now rather than after ``commit_timeout``. Once it has, it alone settles
        the save: a commit already under way stands, and a marker written here could make
        other ranks remove data the commit names. Runs on the loop thread after the
        cancelled ``save`` coroutine has ended, so ``handed_over`` cannot change under it."""
        if plan.spec.distributed is None or plan.handed_over:
            return
        await abandon_part(storage, plan.spec, error)

    def saves_to(self, storage: Storage) -> list[SaveJob]:
        """Saves in flight to the root of ``storage`` (compared by URL: two backends opened
        on one root are one root)."""
        return [job for job in self.jobs.values() if job.storage.url == storage.url]

    async def drain(self, timeout: float | None, storage: Storage | None = None) -> None:
        """Wait for saves in flight (to ``storage`` only, when given); after ``timeout``
        seconds cancel the rest."""
        jobs = self.jobs.values() if storage is None else self.saves_to(storage)
        tasks = {job.task for job in jobs if job.task is not None}
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            raise TimeoutError(
                f"{len(pending)} save(s) did not finish within {timeout} s and were cancelled (each handle says how it "
                "ended: a multi-rank save whose part was delivered may still be committed by its coordinator)"
            )
