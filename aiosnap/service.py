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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from .catalog.steps import committed_steps, manifest_of, remove_everything, remove_steps_after
from .config import Config
from .core.aio import finish_despite_cancel
from .core.arena import Arena
from .core.budget import ByteBudget
from .core.cudaorder import CudaOrder
from .core.events import EventBus, ScopeEmitter
from .core.failures import FailureLedger
from .core.names import attempt_prefix, step_dir
from .core.progress import ProgressBoard, ProgressTracker
from .errors import RankTimeoutError, StepOrderError, UploadProcessError
from .format.manifest import Manifest
from .handoff.contract import FileChunk, SlabChunk, Staged, Transfer, TransferOutcome
from .handoff.spooldir import Spool
from .load.apply import check_pickles
from .load.consistent import read_while_committed
from .load.fetch import ReadPlan, fetch_entries
from .storage.base import Storage
from .trainer.capture import Copier, capture_chunks
from .trainer.chunks import ALIGN, SavePlan
from .trainer.slabs import LoadSlabs, SlabPool
from .trainer.spool import Bounce, SpoolSession
from .transfer.commit import Preflight, whose_commit
from .transfer.heartbeat import Heartbeat
from .transfer.rank_settle import abandon_part, settle_without_transfer
from .transfer.resume import Progress as ResumeProgress
from .transfer.resume import ResumeReport, resume_spooled

__all__ = ["Engine", "ResumeReport", "SaveResult", "slab_bytes_for"]

log = logging.getLogger("aiosnap")

ABORT_GRACE_S = 10.0
"""How long an aborted save waits for the transfer side's outcome once its caller stopped
waiting (``close(timeout)``): an upload process that does not answer by then (stopped,
wedged) is killed; its saves fail with UploadProcessError, except those whose step is read
back as committed."""

CLOSE_LOOK_S = 1.0
"""How long a multi-rank save that ``close(timeout)`` gave up on, whose upload process had to
be killed, still looks for its verdict (its part delivered) before it is left undecided."""

PREFLIGHT_GRACE_S = 1.0
"""How long save() waits, once capture is done, for the look at the root to finish; a
slower store lets save() return and the step order is checked before the commit."""


def slab_bytes_for(config: Config, ram_budget: int) -> int:
    """Chunk (and staging slab) size: ``upload.chunk_size``, at most a quarter of the RAM
    budget so capture and upload overlap, a multiple of the alignment."""
    size = min(config.upload.chunk_size, ram_budget // 4)
    return max(ALIGN, size // ALIGN * ALIGN)


@dataclass(frozen=True)
class SaveResult:
    """Figures of one committed save (seconds are measured from the ``save()`` call)."""

    step: int
    save_id: str
    nbytes: int
    objects: int
    blocked_s: float
    durable_s: float
    ram_high_water: int
    deleted_steps: tuple[int, ...]
    spooled_chunks: int = 0
    """Chunks that went through the local-disk spool."""
    spool_fallback: str | None = None
    """Why spooling stopped for this save (disk full, unwritable), if it did."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds each stage took: capture, spool (when used), upload, commit."""
    spool_high_water: int | None = None
    """Most bytes of spool disk ever held at once (None without a spool)."""

    @property
    def throughput(self) -> float:
        """Bytes per second from ``save()`` to durable."""
        return self.nbytes / self.durable_s if self.durable_s > 0 else 0.0


@dataclass(eq=False)
class _SaveJob:
    """One save attempt in flight (loop thread)."""

    plan: SavePlan
    order: CudaOrder | None
    started: float
    storage: Storage
    keep_last: int | None
    captured: asyncio.Future[float]
    durable: concurrent.futures.Future[SaveResult]
    emit: ScopeEmitter
    preflight: asyncio.Future[Preflight]
    outcome: asyncio.Future[TransferOutcome]
    progress: ProgressTracker
    task: asyncio.Task[None] | None = None
    capture: asyncio.Task[None] | None = None
    session: SpoolSession | None = None
    blocked: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    journalling: set[asyncio.Task[None]] = field(default_factory=set)
    transfer: Transfer | None = None
    """The transfer side this save went to (an upload process that died is replaced for
    later saves; its own saves end with it)."""
    aborted: bool = False
    """Given up before capture ended: it can no longer commit, and holds no step."""
    cancelled_by_close: bool = False
    """Cancelled while it waited for its outcome (``close(timeout)``): the TimeoutError close
    raises reports it, not the UploadProcessError of the helper killed for not answering."""


class Engine:
    """Owns the staging arena and its slabs, the spool, the transfer side and the saves in
    flight. Loop thread only; also the transfer side's listener."""

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
        self.failures = FailureLedger()
        self.slab_bytes = slab_bytes_for(config, ram_budget)
        self.in_process = config.upload.executor == "process"
        count = max(1, ram_budget // self.slab_bytes)
        self.arena = Arena(self.slab_bytes, count, shared=self.in_process)  # reserved; resident where written
        self.budget = ByteBudget(self.arena.size, "ram_budget")
        self.pool: SlabPool | None = None  # made on the loop (it holds an asyncio queue)
        self._bounce: Bounce | None = None
        self._pending: asyncio.Semaphore | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiosnap-copier")
        self._copier = Copier()
        self._jobs: dict[str, _SaveJob] = {}  # save id -> the save in flight
        self._lent: dict[tuple[str, int], tuple[Staged, Transfer]] = {}
        """Every chunk with the transfer side, by (save id, index): its slab comes back with
        done_with, which may arrive after its save has ended (chunks staged after the
        transfer side gave the save up)."""
        self.transfer: Transfer | None = None
        self.board = ProgressBoard()
        """The progress of the saves in flight (a live display reads it)."""
        self._told_over_budget = False
        self._securing = False
        """Preempted: chunks held in RAM are written to the spool too (see :meth:`preempted`)."""

    async def start(self) -> None:
        """Make the slab pool and the transfer side (starting the upload process in
        ``process`` mode) as the checkpointer starts, and warm the copier up; loop thread."""
        self._ready()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._copier.warm_up)

    def _ready(self) -> tuple[SlabPool, Transfer]:
        """The pool and the transfer side (a new upload process if the last one died)."""
        pool = self._slab_pool()
        if self.transfer is None or getattr(self.transfer, "dead", None) is not None:
            if self.in_process:
                from .transfer.process import ProcessTransfer

                self.transfer = ProcessTransfer(self.config, self.arena, self)
            else:
                from .transfer.local import LocalTransfer

                self.transfer = LocalTransfer(self.config, self.arena, self)
            self.transfer.open_root(self.storage.url, self.storage)
        return pool, self.transfer

    def _slab_pool(self) -> SlabPool:
        """The staging slabs (made on first use)."""
        if self.pool is None:
            self.pool = SlabPool(self.arena, self.budget)
            if self.spool is not None and self.spool.mode == "overflow":
                if self.arena.count < 2:
                    log.warning("aiosnap: the RAM budget holds one slab: no bounce slab, spooling is off")
                else:  # one slab of the budget is set aside to spill through when the rest is lent
                    self._bounce = Bounce(self.pool)
        return self.pool

    def _say_if_over_budget(self, plan: SavePlan) -> None:
        """Once per engine: a state larger than the RAM budget, with no spool to spill to,
        makes save() wait for uploads (said through logging at WARNING, which Python shows
        on stderr even when logging is not set up)."""
        if self._told_over_budget or self.spool is not None or plan.total_bytes <= self.budget.capacity:
            return
        self._told_over_budget = True
        over = plan.total_bytes - self.budget.capacity
        log.warning(
            "aiosnap: the state of step %d (%.1f MiB) is larger than the RAM budget (%.1f MiB) and no spool is "
            "configured: save() returns only once %.1f MiB have reached storage. Raise ram_budget, or set "
            "spool.dir to spill to local disk and return at disk speed (said once).",
            plan.step, plan.total_bytes / 2**20, self.budget.capacity / 2**20, over / 2**20,
        )  # fmt: skip

    def raise_unobserved(self) -> None:
        """Raise the oldest background failure nobody has been told about (once)."""
        failure = self.failures.take()
        if failure is not None:
            raise failure

    def _check_order(self, step: int, storage: Storage) -> None:
        """Refuse a step at or below one this engine is saving to the same root."""
        for job in self._jobs.values():
            if job.storage.url == storage.url and job.plan.step >= step and not job.aborted:
                what = "already being saved" if job.plan.step == step else f"older than step {job.plan.step}"
                raise StepOrderError(
                    f"step {step} is {what}, whose save to {storage.url} is still in flight: "
                    "steps only move forward; wait for that save's handle first"
                )

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
        self.raise_unobserved()
        self._check_order(plan.step, storage)
        self._say_if_over_budget(plan)
        if self._pending is None:
            self._pending = asyncio.Semaphore(self.config.max_pending_saves)
        bridge = self._bridge(plan, storage)
        try:
            await self._pending.acquire()
        except BaseException:
            await self._drop_bridge(bridge, storage, plan)
            raise
        try:
            self.raise_unobserved()  # a save that failed while we waited
            self._check_order(plan.step, storage)
            pool, transfer = self._ready()
            if order is not None:
                pool.pin()
            transfer.open_root(storage.url, storage)
        except BaseException:
            self._pending.release()
            await self._drop_bridge(bridge, storage, plan)
            raise
        loop = asyncio.get_running_loop()
        durable: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        durable.set_running_or_notify_cancel()  # nobody may cancel it from outside
        job = _SaveJob(
            plan, order, started, storage, keep_last, loop.create_future(), durable,
            self.events.scope("save", plan.step, storage.url, plan.save_id), loop.create_future(),
            loop.create_future(), progress or ProgressTracker(plan.step, plan.total_bytes, started),
        )  # fmt: skip
        job.transfer = transfer
        job.progress.stage("capturing")
        self.board.add(job.progress)
        self._jobs[plan.save_id] = job
        job.emit("start")
        if bridge is not None:  # until the transfer side beats (its look at the root is back) or the save ends
            for future in (job.preflight, job.outcome):
                future.add_done_callback(lambda _: bridge.hand_over())
        try:
            transfer.begin(plan.save_id, storage.url, keep_last, plan.spec)
            plan.handed_over = True
        except BaseException as exc:  # the upload process is gone: this save never started
            self._jobs.pop(plan.save_id, None)
            self.board.discard(job.progress)
            job.progress.stage("failed")
            self._pending.release()
            job.emit("exception", exception=exc)
            durable.set_exception(exc)
            durable.exception()  # raised here, by save() itself
            await self._drop_bridge(bridge, storage, plan)
            raise
        job.task = loop.create_task(self._run(job))
        job.task.add_done_callback(lambda task: self._forget(job))
        try:
            await asyncio.shield(job.captured)
        except asyncio.CancelledError:
            self.abort(plan.save_id)
            raise
        return durable

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
    async def _drop_bridge(bridge: Heartbeat | None, storage: Storage, plan: SavePlan) -> None:
        """A save that never began: no heartbeat, and no empty folder, left behind."""
        if bridge is None:
            return
        await finish_despite_cancel(bridge.stop())
        try:
            await storage.remove_empty_folder(attempt_prefix(plan.step, plan.save_id))
            await storage.remove_empty_folder(step_dir(plan.step))
        except Exception as exc:
            log.debug("aiosnap: removing the folder of a save that never began failed: %r", exc)

    async def leave(self, plan: SavePlan, storage: Storage, error: BaseException) -> None:
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

    def abort(self, save_id: str) -> None:
        """The caller gave up on ``save()`` before receiving its handle: abort that save
        unless its commit has begun (then it stands). Loop thread."""
        job = self._jobs.get(save_id)
        if job is None or job.task is None:
            return
        if not job.captured.done():
            job.aborted = True  # its retry may start while the transfer side winds it down
            job.task.cancel()  # (if it never ran, only the next line tells the transfer side)
        self._abort_transfer(job)

    @staticmethod
    def _abort_transfer(job: _SaveJob, *, even_committing: bool = False) -> None:
        """Tell the save's transfer side to give it up; never raises (an upload process that
        is gone fails that save by itself)."""
        if job.transfer is None:
            return
        try:
            job.transfer.abort(job.plan.save_id, even_committing=even_committing)
        except Exception as exc:
            log.debug("aiosnap: aborting %s on the transfer side failed: %r", job.plan.save_id, exc)

    def _saves_to(self, storage: Storage) -> list[_SaveJob]:
        """Saves in flight to the root of ``storage`` (compared by URL: two backends opened
        on one root are one root)."""
        return [job for job in self._jobs.values() if job.storage.url == storage.url]

    def _forget(self, job: _SaveJob) -> None:
        """Done callback of a save's task, however it ended (cancelled before its first
        step included): free its slot and its name, and settle whatever is not settled."""
        assert self._pending is not None
        self._jobs.pop(job.plan.save_id, None)
        self._pending.release()
        self.board.discard(job.progress)
        job.progress.stage("cancelled")  # (a save that ended otherwise stays as it ended)
        if not job.captured.done():
            job.captured.cancel()
        if not job.durable.done():
            job.emit("exception", exception=asyncio.CancelledError())
            job.durable.set_exception(concurrent.futures.CancelledError(f"save of step {job.plan.step} was cancelled"))

    async def _run(self, job: _SaveJob) -> None:
        failure: BaseException | None = None
        job.capture = asyncio.ensure_future(self._capture(job))
        try:
            await job.capture
        except asyncio.CancelledError as exc:
            if not job.capture.done():  # the caller (or close) cancelled this save
                job.capture.cancel()
                await asyncio.wait([job.capture])
            failure = exc if not job.outcome.done() else None  # else: the transfer side failed first
        except BaseException as exc:
            failure = exc
        if failure is not None or not job.captured.done():
            self._abort_transfer(job)
        outcome = await self._outcome(job)  # (a chunk staged after it still comes back: self._lent)
        await finish_despite_cancel(self._end_session(job))
        if outcome.committed:
            self._succeed(job, outcome)
        else:
            self._fail(job, failure if failure is not None else (outcome.error or asyncio.CancelledError()))

    async def _outcome(self, job: _SaveJob) -> TransferOutcome:
        """Wait for the transfer side's outcome; cancelled meanwhile (close(timeout)), ask
        it to abort and wait on: it always reports -- or, an upload process that does not
        within :data:`ABORT_GRACE_S`, is killed and its end reports for it."""
        given_up = False
        while True:
            try:
                if not given_up:
                    return await asyncio.shield(job.outcome)
                await asyncio.wait([job.outcome], timeout=ABORT_GRACE_S)
                if job.outcome.done():
                    return job.outcome.result()
                kill = getattr(job.transfer, "kill", None)  # an upload process that does not answer
                if kill is None:
                    given_up = False
                    continue
                log.warning("aiosnap: the upload process did not answer an abort in %g s; killing it", ABORT_GRACE_S)
                kill()  # its end of file fails every save it had (transfer_lost)
                return await asyncio.shield(job.outcome)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                self._abort_transfer(job, even_committing=True)
                given_up = job.cancelled_by_close = True

    async def _capture(self, job: _SaveJob) -> None:
        """Copy every chunk, check the step order, and let save() return."""
        pool, transfer = self.pool, job.transfer
        assert pool is not None
        assert transfer is not None
        plan = job.plan
        if job.outcome.done():  # refused by the transfer side before anything was copied
            return
        job.session = self._spool_session(plan, job.storage, job.keep_last)
        if self._securing:  # a save started after a preemption (the trainer's last one)
            self._keep_resumable(job)
        capture_started = time.perf_counter()
        await capture_chunks(
            plan, pool, self._executor, self._copier, job.order,
            stage=lambda chunk: self._stage(job, chunk),
            may_upload=lambda: transfer.may_upload(plan.save_id),
            spool=job.session,
        )  # fmt: skip
        if job.session is not None:
            await job.session.captured()  # the journal says so before save() returns
        capture_done = time.perf_counter()
        if job.outcome.done():  # the transfer side failed meanwhile: save() reports it
            return
        await self._check_preflight(job)
        job.blocked = time.perf_counter() - job.started
        job.stages["capture"] = capture_done - capture_started
        job.captured.set_result(job.blocked)
        job.progress.stage("uploading")
        job.emit("end", stage="capture", nbytes=plan.total_bytes, seconds=job.stages["capture"])
        if job.session is not None and job.session.spooled:
            job.stages["spool"] = job.session.spool_seconds
            job.emit("end", stage="spool", nbytes=job.session.spooled_bytes, seconds=job.session.spool_seconds)
        transfer.captured(plan.save_id)

    def _stage(self, job: _SaveJob, chunk: Staged) -> None:
        assert job.transfer is not None
        self._lent[(job.plan.save_id, chunk.index)] = (chunk, job.transfer)
        job.progress.captured(job.plan.chunks[chunk.index].payload, spooled=isinstance(chunk, FileChunk))
        job.transfer.staged(chunk)
        if self._securing and isinstance(chunk, SlabChunk):
            self._secure(job, chunk)

    def preempted(self) -> None:
        """A preemption signal came (:mod:`aiosnap.core.preemption`); loop thread. The saves
        in flight go on; with a spool, every chunk they hold in RAM, and every one staged
        from now on, is written to the spool disk as well, so that a save the grace period
        is too short for is resumed by the next process. (Multi-rank saves are not resumed
        from a spool: their ranks only try to finish.) Every such save is journalled, even
        one with nothing left in RAM (its commit under way)."""
        if self._securing:
            return
        self._securing = True
        for (save_id, _), (chunk, _) in list(self._lent.items()):
            job = self._jobs.get(save_id)
            if job is not None and isinstance(chunk, SlabChunk):
                self._secure(job, chunk)
        for job in list(self._jobs.values()):
            self._keep_resumable(job)

    def _keep_resumable(self, job: _SaveJob) -> None:
        """Preempted: journal ``job`` whatever it holds in RAM (see SpoolSession.keep_resumable)."""
        if job.session is not None and job.plan.spec.distributed is None and not job.aborted:
            self._journalling(job, job.session.keep_resumable())

    def _secure(self, job: _SaveJob, chunk: SlabChunk) -> None:
        """Write ``chunk`` (in RAM) to the save's spool folder, holding its slab meanwhile."""
        session, pool = job.session, self.pool
        if session is None or pool is None or job.plan.spec.distributed is not None or job.aborted:
            return
        pool.hold(chunk.slab)

        async def write() -> None:
            try:
                data = self.arena.view(chunk.slab, chunk.nbytes)
                if await session.secure(job.plan.chunks[chunk.index], data):
                    job.progress.spooled(job.plan.chunks[chunk.index].payload)
            except Exception as exc:  # the save itself goes on
                log.warning("aiosnap: keeping chunk %d of step %d on the spool: %r", chunk.index, job.plan.step, exc)
            finally:
                pool.unhold(chunk.slab)

        self._journalling(job, write())

    @staticmethod
    def _journalling(job: _SaveJob, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (spool and journal writes) as a task the end of ``job`` waits for."""
        task = asyncio.get_running_loop().create_task(work)
        job.journalling.add(task)
        task.add_done_callback(job.journalling.discard)

    @staticmethod
    async def _check_preflight(job: _SaveJob) -> None:
        """Refuse the step in save() itself when the look at the root is back in time;
        otherwise (a slow store, or one that failed: a background failure like any other)
        it is checked before the commit, on the transfer side."""
        if not job.preflight.done():
            await asyncio.wait([job.preflight], timeout=PREFLIGHT_GRACE_S)
        if job.preflight.done() and job.preflight.exception() is None:
            job.preflight.result().check(job.storage.url)

    async def _end_session(self, job: _SaveJob) -> None:
        if job.journalling:
            await asyncio.wait(set(job.journalling))
        if job.session is not None:
            await job.session.finish()

    def _succeed(self, job: _SaveJob, outcome: TransferOutcome) -> None:
        session = job.session
        result = SaveResult(
            step=job.plan.step,
            save_id=job.plan.save_id,
            nbytes=job.plan.total_bytes,
            objects=len(job.plan.chunks),
            blocked_s=job.blocked,
            durable_s=time.perf_counter() - job.started,
            ram_high_water=self.budget.high_water,
            deleted_steps=outcome.deleted_steps,
            spooled_chunks=0 if session is None else session.spooled,
            spool_fallback=None if session is None else session.fallback,
            stage_seconds={**job.stages, **outcome.stage_seconds},
            spool_high_water=None if self.spool is None else self.spool.budget.high_water,
        )
        job.progress.stage("committed")
        job.emit("end", nbytes=result.nbytes, seconds=result.durable_s)
        if not job.captured.done():
            job.captured.set_result(result.blocked_s)
        job.durable.set_result(result)

    def _fail(self, job: _SaveJob, failure: BaseException) -> None:
        """Report ``failure`` once: by save() itself when it has not returned yet, else to
        whoever waits for the handle, else by the next save() or close()."""
        step = job.plan.step
        cancelled = isinstance(failure, asyncio.CancelledError)
        job.progress.stage("cancelled" if cancelled else "failed")
        job.emit("exception", exception=failure)
        if not job.captured.done():
            if cancelled:
                job.captured.cancel()
            else:
                job.captured.set_exception(failure)
                job.captured.exception()  # seen by save(), or by nobody if save() was cancelled
        elif not cancelled and not (
            job.cancelled_by_close and isinstance(failure, (UploadProcessError, RankTimeoutError))
        ):  # (close's own TimeoutError reports a save it gave up on)
            self.failures.record(failure)  # before the handle can hand it out: see FailureLedger
        if cancelled:
            job.durable.set_exception(concurrent.futures.CancelledError(f"save of step {step} was cancelled"))
        else:
            job.durable.set_exception(failure)

    def _spool_session(self, plan: SavePlan, storage: Storage, keep_last: int | None) -> SpoolSession | None:
        if self.spool is None or self.pool is None:
            return None
        return SpoolSession(self.spool, plan, storage.url, self.storage.url, self.pool, self._bounce, keep_last)

    # -- what the transfer side tells (TransferListener) ------------------------------------

    def preflight(self, save_id: str, latest: int | None, error: BaseException | None) -> None:
        job = self._jobs.get(save_id)
        if job is None or job.preflight.done():
            return
        if error is not None:
            job.preflight.set_exception(error)
            job.preflight.exception()  # the transfer side reports it, if it matters
        else:
            job.preflight.set_result(Preflight(job.plan.step, latest))

    def done_with(self, save_id: str, index: int, pieces: list[int] | None) -> None:
        chunk, _ = self._lent.pop((save_id, index), (None, None))
        if isinstance(chunk, SlabChunk) and self.pool is not None:
            self.pool.release(chunk.slab)
        job = self._jobs.get(save_id)
        if job is None:
            return
        if pieces is not None:
            job.progress.landed(index, job.plan.chunks[index].payload)
        else:
            job.progress.dropped(index)
        if job.session is not None and (chunk is not None or pieces is not None):
            self._journalling(job, job.session.done_with(index, pieces))

    def sent(self, save_id: str, index: int, nbytes: int) -> None:
        job = self._jobs.get(save_id)
        if job is not None and 0 <= index < len(job.plan.chunks):
            job.progress.sending(index, nbytes, job.plan.chunks[index].payload)

    def stage_ended(self, save_id: str, stage: str, nbytes: int, seconds: float) -> None:
        job = self._jobs.get(save_id)
        if job is not None:
            job.stages[stage] = seconds
            if stage == "upload":
                job.progress.stage("committing")
            job.emit("end", stage=stage, nbytes=nbytes, seconds=seconds)

    def finished(self, save_id: str, outcome: TransferOutcome) -> None:
        job = self._jobs.get(save_id)
        if job is None or job.outcome.done():
            return
        job.outcome.set_result(outcome)
        if job.capture is not None and not job.capture.done():
            job.capture.cancel()  # the transfer side failed while capture went on: stop it

    def transfer_lost(self, error: BaseException, transfer: Transfer | None = None) -> None:
        """The upload process ``transfer`` died: its slabs come back (nobody reads them any
        more), its saves fail with ``error``, their spool folders stay for a later resume. A
        save whose upload stage had ended may have committed: its step is read back first."""
        for (save_id, index), (_, owner) in list(self._lent.items()):
            if transfer is None or owner is transfer:
                self.done_with(save_id, index, None)
        for job in list(self._jobs.values()):
            if transfer is not None and job.transfer is not transfer:
                continue
            if job.session is not None:
                job.session.keep = True
            if not job.preflight.done():
                job.preflight.set_exception(error)
                job.preflight.exception()
            if job.outcome.done():
                continue
            if job.plan.spec.distributed is not None:  # the other ranks must hear of it
                self._journalling(job, self._rank_lost(job, error))
            elif "upload" in job.stages:  # its commit may have begun, or landed
                self._journalling(job, self._read_back(job, error))
            else:
                self.finished(job.plan.save_id, TransferOutcome(committed=False, error=error))

    async def _rank_lost(self, job: _SaveJob, error: BaseException) -> None:
        """The upload process died with this rank's part of a multi-rank save: leave the
        marker the other ranks need, or (its part delivered) wait here for the verdict --
        briefly (:data:`CLOSE_LOOK_S`) when ``close(timeout)`` gave the save up, which then
        ends undecided."""
        wait_s = CLOSE_LOOK_S if job.cancelled_by_close else None
        try:
            await settle_without_transfer(job.storage, job.plan.spec, error, self.config.distributed, wait_s=wait_s)
            outcome = TransferOutcome(committed=True)
        except Exception as exc:
            outcome = TransferOutcome(committed=False, error=exc)
        self.finished(job.plan.save_id, outcome)

    async def _read_back(self, job: _SaveJob, error: BaseException) -> None:
        """The transfer side died after a save's upload stage: did its commit land?"""
        try:
            verdict = await whose_commit(job.storage, job.plan.step, job.plan.save_id, write_interrupted=True)
        except Exception as exc:
            log.debug("aiosnap: reading back step %d failed: %r", job.plan.step, exc)
            verdict = "unknown"
        if verdict == "ours":
            log.info("aiosnap: step %d committed although its upload process died", job.plan.step)
            self.finished(job.plan.save_id, TransferOutcome(committed=True))
            return
        if verdict == "unknown":
            log.warning(
                "aiosnap: the commit of step %d may or may not have landed (%r); its data is left for `aiosnap gc`",
                job.plan.step, error,
            )  # fmt: skip
        self.finished(job.plan.save_id, TransferOutcome(committed=False, error=error))

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
            slabs = self._load_slabs(plan)
            return manifest, await fetch_entries(storage, manifest, self.config.upload.concurrency, plan, slabs)

        async with storage.reading():  # a step removed meanwhile (another job's retention): see load.consistent
            return await read_while_committed(storage, step, fetch)

    def _load_slabs(self, plan: ReadPlan) -> LoadSlabs:
        """The staging slabs a load borrows (from the saves' pool, under the same RAM
        budget; pinned when it copies into CUDA tensors) for what it cannot read straight
        into its destination."""
        pool = self._slab_pool()
        targets = [*plan.staged.values(), *(t.dest for boxes in plan.shards.values() for t in boxes)]
        if any(t.device.type == "cuda" for t in targets):
            pool.pin()
        return LoadSlabs(pool)

    async def manifest(self, step: int | None, storage: Storage) -> Manifest:
        """The manifest of ``step`` (latest committed when None), without reading data."""
        return await manifest_of(storage, step)

    async def purge(self, storage: Storage) -> list[int]:
        """Wait for the saves to ``storage``, then delete every step under it."""
        await self.drain(None, storage)
        return await remove_everything(storage)

    async def rollback(self, storage: Storage, step: int) -> list[int]:
        """Wait for the saves to ``storage``, then remove the committed steps after ``step``."""
        await self.drain(None, storage)
        return await remove_steps_after(storage, step)

    async def drain(self, timeout: float | None, storage: Storage | None = None) -> None:
        """Wait for saves in flight (to ``storage`` only, when given); after ``timeout``
        seconds cancel the rest."""
        jobs = self._jobs.values() if storage is None else self._saves_to(storage)
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

    async def resume(
        self, progress: ResumeProgress | None = None, storage: Storage | None = None, keep_last: int | None = None
    ) -> ResumeReport:
        """Finish the spooled saves an earlier process left behind for ``storage`` (this
        engine's own root by default), with retention ``keep_last`` (see transfer.resume)."""
        if self.spool is None:
            return ResumeReport()
        target = self.storage if storage is None else storage
        return await resume_spooled(
            self.spool,
            target,
            concurrency=self.config.upload.concurrency,
            keep_last=self.config.retention.keep_last if storage is None else keep_last,
            owner_url=self.storage.url,
            live=set(self._jobs),
            progress=progress,
            events=self.events,
        )

    async def shutdown(self) -> None:
        """Free the transfer side (removals of failed attempts get a bounded wait; the rest
        is left to ``aiosnap gc``), the arena, the spool lock and connections (after drain)."""
        if self.transfer is not None:
            await self.transfer.close()
        if self.pool is not None:
            self.pool.close()
        if self.spool is not None:
            self.spool.close()
        self._executor.shutdown(wait=True)
        await self.storage.close()
        self.pool = None
        self.arena.close()
