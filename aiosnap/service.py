"""The engine: every save and load as it runs on the trainer's background loop thread.

The public :class:`~aiosnap.Checkpointer` and :class:`~aiosnap.SyncCheckpointer` plan on the
caller's thread and hand coroutines of this class to the loop. A save here is the trainer
side: wait for a pending-save slot (backpressure), copy every chunk into the staging arena
(or the spool) and hand each on, as a descriptor, to the transfer side
(:mod:`aiosnap.transfer`: upload, commit, retention), which runs on this same loop
(``upload.executor: thread``) or in the upload process (``process``). ``save()`` returns
once every byte is captured and the step order is checked; the handle resolves when the
transfer side reports the outcome. Cancelling ``save()`` before it returned aborts that
save; afterwards the save lives on its own. A failure is reported once
(:mod:`aiosnap.core.failures`). Loads, listings and removals run here, on this process's own
storage. All state below is touched by the loop thread alone (the ledger excepted).

:class:`Engine` is a facade over the parts in :mod:`aiosnap.runtime`: the staging
resources (:class:`~aiosnap.runtime.resources.Resources`), admission (pending-save slots,
step order, failure ledger, drain: :class:`~aiosnap.runtime.admission.Admission`), the link
to the transfer side (:class:`~aiosnap.runtime.transferlink.TransferLink`, its listener) and
one :class:`~aiosnap.runtime.savejob.SaveJob` per save in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

import torch

from .catalog.steps import committed_steps, manifest_of, remove_everything, remove_steps_after
from .config import Config
from .core.arena import Arena
from .core.budget import ByteBudget
from .core.cudaorder import CudaOrder
from .core.events import EventBus
from .core.failures import FailureLedger
from .core.progress import ProgressBoard, ProgressTracker
from .format.manifest import Manifest
from .handoff.contract import Staged, Transfer
from .handoff.spooldir import Spool
from .load.apply import check_pickles
from .load.consistent import read_while_committed
from .load.fetch import ReadPlan, fetch_entries
from .runtime.admission import Admission
from .runtime.resources import Resources, slab_bytes_for
from .runtime.savejob import JobContext, SaveJob, SaveResult
from .runtime.transferlink import TransferLink
from .storage.base import Storage
from .trainer.chunks import SavePlan
from .trainer.slabs import SlabPool
from .transfer.resume import Progress as ResumeProgress
from .transfer.resume import ResumeReport, resume_spooled

__all__ = ["Engine", "ResumeReport", "SaveResult", "slab_bytes_for"]


class Engine:
    """Owns the staging resources, the spool, the link to the transfer side and the saves
    in flight (composed, see the module's docstring). Loop thread only."""

    def __init__(
        self,
        config: Config,
        storage: Storage,
        ram_budget: int,
        events: EventBus,
        spool: Spool | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.events = events
        self.spool = spool
        self.in_process = config.upload.executor == "process"
        self.resources = Resources(config, ram_budget, spool)
        self.admission = Admission(config)
        self.link = TransferLink(config, storage, self.resources, self.admission.jobs)
        self._context = JobContext(self.resources, self.link, self.admission.failures, storage.url)

    # -- the parts' state, by the names the checkpointer and tests use -----------------------

    @property
    def failures(self) -> FailureLedger:
        return self.admission.failures

    @property
    def board(self) -> ProgressBoard:
        """The progress of the saves in flight (a live display reads it)."""
        return self.admission.board

    @property
    def slab_bytes(self) -> int:
        return self.resources.slab_bytes

    @property
    def arena(self) -> Arena:
        return self.resources.arena

    @property
    def budget(self) -> ByteBudget:
        return self.resources.budget

    @property
    def pool(self) -> SlabPool | None:
        return self.resources.pool

    @property
    def transfer(self) -> Transfer | None:
        return self.link.transfer

    @property
    def _jobs(self) -> dict[str, SaveJob]:
        return self.admission.jobs

    @property
    def _lent(self) -> dict[tuple[str, int], tuple[Staged, Transfer]]:
        return self.link.lent

    async def start(self) -> None:
        """Make the slab pool and the transfer side (starting the upload process in
        ``process`` mode) as the checkpointer starts, and warm the copier up; loop thread."""
        self.resources.slab_pool()
        self.link.ready()
        await self.resources.warm_up()

    def raise_unobserved(self) -> None:
        """Raise the oldest background failure nobody has been told about (once)."""
        self.admission.raise_unobserved()

    def preempted(self) -> None:
        """A preemption signal came: see :meth:`TransferLink.preempted`; loop thread."""
        self.link.preempted()

    # -- a save, trainer side -------------------------------------------------------------

    async def save(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        storage: Storage,
        keep_last: int | None,
        progress: ProgressTracker | None = None,
    ) -> concurrent.futures.Future[SaveResult]:
        """Start a save to ``storage``; returns once every byte is captured, with a future
        for durability. ``keep_last`` is the retention applied there after the commit;
        ``progress`` hears how far the save has got. Cancelled before it returns, the save
        is aborted: nothing of it is committed."""
        admission = self.admission
        admission.raise_unobserved()
        admission.check_order(plan.step, storage)
        admission.say_if_over_budget(plan, self.budget.capacity, self.spool is not None)
        bridge = await admission.enter(plan, storage)
        try:
            pool, transfer = self.resources.slab_pool(), self.link.ready()
            if order is not None:
                pool.pin()
            transfer.open_root(storage.url, storage)
        except BaseException:
            await admission.withdraw(bridge, storage, plan)
            raise
        job = SaveJob(
            self._context, plan, order, started, storage, keep_last,
            self.events.scope("save", plan.step, storage.url, plan.save_id),
            progress or ProgressTracker(plan.step, plan.total_bytes, started), transfer,
        )  # fmt: skip
        job.progress.stage("capturing")
        admission.add(job)
        job.emit("start")
        if bridge is not None:  # until the transfer side beats (its look at the root is back) or the save ends
            for future in (job.preflight, job.outcome):
                future.add_done_callback(lambda _: bridge.hand_over())
        try:
            transfer.begin(plan.save_id, storage.url, keep_last, plan.spec)
            plan.handed_over = True
            self.link.look_meanwhile(job)
        except BaseException as exc:  # the upload process is gone: this save never started
            admission.board.discard(job.progress)
            job.never_began(exc)
            await admission.withdraw(bridge, storage, plan)
            raise
        job.task = asyncio.get_running_loop().create_task(job.run())
        job.task.add_done_callback(lambda task: admission.forget(job))
        try:
            await asyncio.shield(job.captured)
        except asyncio.CancelledError:
            self.abort(plan.save_id)
            raise
        return job.durable

    async def leave(self, plan: SavePlan, storage: Storage, error: BaseException) -> None:
        """``save()`` of a multi-rank ``plan`` failed on this rank after the ranks agreed:
        see :meth:`Admission.leave`; loop thread."""
        await self.admission.leave(plan, storage, error)

    def abort(self, save_id: str) -> None:
        """The caller gave up on ``save()`` before receiving its handle: abort that save
        unless its commit has begun (then it stands). Loop thread."""
        job = self.admission.jobs.get(save_id)
        if job is not None:
            job.abort()

    # -- loads, listings, removals (this process's own storage) -----------------------------

    async def steps(self, storage: Storage) -> list[int]:
        """Committed steps, ascending."""
        return await committed_steps(storage)

    async def read(
        self,
        step: int | None,
        allow_pickle: bool,
        storage: Storage,
        select: Callable[[Manifest], ReadPlan] | None = None,
        view: Callable[[Manifest], Manifest] | None = None,
    ) -> tuple[Manifest, dict[int, torch.Tensor]]:
        """The manifest of ``step`` (latest committed when None) as ``view`` shows it (a
        rank's view of a multi-rank checkpoint) and its verified tensors (as
        ``select(manifest)`` plans: a partial load, reads into the caller's tensors), all
        from one version of the checkpoint."""

        async def fetch(manifest: Manifest) -> tuple[Manifest, dict[int, torch.Tensor]]:
            if view is not None:
                manifest = view(manifest)
            plan = ReadPlan() if select is None else select(manifest)
            check_pickles(manifest, allow_pickle, plan.only)
            slabs = self.resources.load_slabs(plan)
            return manifest, await fetch_entries(storage, manifest, self.config.upload.concurrency, plan, slabs)

        async with storage.reading():  # a step removed meanwhile (another job's retention): see load.consistent
            return await read_while_committed(storage, step, fetch)

    async def manifest(self, step: int | None, storage: Storage) -> Manifest:
        """The manifest of ``step`` (latest committed when None), without reading data."""
        return await manifest_of(storage, step)

    async def purge(self, storage: Storage) -> list[int]:
        """Wait for the saves to ``storage``, then delete every step under it (no new save
        to it is admitted meanwhile)."""
        async with self.admission.hold(storage):
            await self.drain(None, storage)
            return await remove_everything(storage)

    async def rollback(self, storage: Storage, step: int) -> list[int]:
        """Wait for the saves to ``storage``, then remove the committed steps after ``step``
        (no new save to it is admitted meanwhile)."""
        async with self.admission.hold(storage):
            await self.drain(None, storage)
            return await remove_steps_after(storage, step)

    async def drain(self, timeout: float | None, storage: Storage | None = None) -> None:
        """Wait for saves in flight (to ``storage`` only, when given); after ``timeout``
        seconds cancel the rest (see :meth:`Admission.drain`)."""
        await self.admission.drain(timeout, storage)

    async def resume(
        self, progress: ResumeProgress | None = None, storage: Storage | None = None, keep_last: int | None = None
    ) -> ResumeReport:
        """Finish the spooled saves an earlier process left behind for ``storage`` (this
        engine's own root by default), with retention ``keep_last`` (see transfer.resume).
        The saves in flight to that root finish first, and no new one is admitted meanwhile:
        a resumed step commits and runs retention, which must not delete what a save in
        flight names (its base)."""
        if self.spool is None:
            return ResumeReport()
        target = self.storage if storage is None else storage
        async with self.admission.hold(target):
            await self.drain(None, target)
            return await resume_spooled(
                self.spool,
                target,
                concurrency=self.config.upload.concurrency,
                keep_last=self.config.retention.keep_last if storage is None else keep_last,
                owner_url=self.storage.url,
                live=set(self.admission.jobs),
                progress=progress,
                events=self.events,
            )

    async def shutdown(self) -> None:
        """Free the transfer side (removals of failed attempts get a bounded wait; the rest
        is left to ``aiosnap gc``), the arena, the spool lock and connections (after drain)."""
        await self.link.close()
        self.resources.close_pool()
        if self.spool is not None:
            self.spool.close()
        self.resources.stop_copier()
        await self.storage.close()
        self.resources.free()
