"""The engine: every save and load as it runs on the background loop thread.

The public :class:`~aiosnap.Checkpointer` and :class:`~aiosnap.SyncCheckpointer` only plan
on the caller's thread and hand coroutines of this class to the loop; all state below is
touched by the loop thread alone (the :class:`~aiosnap.failures.FailureLedger` excepted).

A save: wait for a pending-save slot (backpressure) -> look at the root (preflight, in
parallel with the copy) -> capture every chunk into RAM slabs (``save()`` returns here) ->
upload workers write and checksum chunks, releasing slabs -> manifest (commit) ->
retention. The commit protocol (:mod:`aiosnap.transfer.commit`) decides what a failure
may remove. Cancelling ``save()`` before it returned aborts that save; afterwards the
save lives on its own. A failure is reported once (:mod:`aiosnap.failures`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .aio import complete_before_cancel
from .budget import ByteBudget
from .catalog.steps import apply_retention, committed_steps, manifest_of, remove_everything, remove_steps_after
from .config import Config
from .errors import StepOrderError, first_error
from .events import EventBus, ScopeEmitter
from .failures import FailureLedger
from .format.manifest import Checksums, Manifest, build_manifest
from .load.apply import check_pickles
from .load.fetch import fetch_entries
from .storage.base import Storage
from .trainer.capture import BufferPool, Copier, CudaOrder, StagedChunk, capture_chunks
from .trainer.plan import ALIGN, SavePlan
from .trainer.spool import Bounce, Spool, SpoolSession
from .transfer.commit import Preflight, commit_manifest, preflight, remove_attempt, whose_commit
from .transfer.resume import Progress as ResumeProgress
from .transfer.resume import ResumeReport, resume_spooled
from .transfer.upload import upload_worker

__all__ = ["Engine", "ResumeReport", "SaveResult", "slab_bytes_for"]

log = logging.getLogger("aiosnap")

PREFLIGHT_GRACE_S = 1.0
"""How long save() waits, once capture is done, for the look at the root to finish; a
slower store lets save() return and the step order is checked before the commit."""
CLEANUP_WAIT_S = 10.0
"""How long close() lets the removal of failed attempts run before leaving them to gc."""


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


class _StageClock:
    """When the upload stage ran: first chunk taken to last chunk landed. Loop thread."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None

    def began(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def landed(self) -> None:
        self.last = time.perf_counter()

    @property
    def seconds(self) -> float:
        return 0.0 if self.first is None or self.last is None else self.last - self.first


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
    task: asyncio.Task[None] | None = None
    session: SpoolSession | None = None
    blocked: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    commit_started: bool = False
    result: SaveResult | None = None
    """Set once the manifest is written (retention may still follow)."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done callback: mark a side task's outcome as seen (its failure is reported elsewhere)."""
    if not task.cancelled():
        task.exception()


class Engine:
    """Owns storage, the RAM budget and its slabs, and the saves in flight. Loop thread only."""

    def __init__(
        self, config: Config, storage: Storage, ram_budget: int, events: EventBus, spool: Spool | None = None
    ) -> None:
        self.config = config
        self.storage = storage
        self.events = events
        self.budget = ByteBudget(ram_budget, "ram_budget")
        self.slab_bytes = slab_bytes_for(config, ram_budget)
        self.spool = spool
        self.failures = FailureLedger()
        self._bounce: Bounce | None = None
        if spool is not None and spool.mode == "overflow":
            # one slab of the RAM budget is set aside to spill through when the rest is taken
            if not self.budget.try_acquire(self.slab_bytes):
                raise AssertionError("a fresh budget always has room for one slab")
            self._bounce = Bounce(self.slab_bytes)
        self._pool: BufferPool | None = None
        self._pending: asyncio.Semaphore | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiosnap-copier")
        self._copier = Copier()
        self._jobs: dict[str, _SaveJob] = {}  # save id -> the save in flight
        self._cleanups: set[asyncio.Task[None]] = set()

    def _pool_for(self, plan: SavePlan) -> BufferPool:
        if self._pool is None:
            cuda = any(e.tensor.device.type == "cuda" for e in plan.entries)
            self._pool = BufferPool(self.budget, self.slab_bytes, pin_memory=cuda and torch.cuda.is_available())
        return self._pool

    def raise_unobserved(self) -> None:
        """Raise the oldest background failure nobody has been told about (once)."""
        failure = self.failures.take()
        if failure is not None:
            raise failure

    def _check_order(self, step: int, storage: Storage) -> None:
        """Refuse a step at or below one this engine is saving to the same root."""
        for job in self._jobs.values():
            if job.storage.url == storage.url and job.plan.step >= step:
                what = "already being saved" if job.plan.step == step else f"older than step {job.plan.step}"
                raise StepOrderError(
                    f"step {step} is {what}, whose save to {storage.url} is still in flight: "
                    "steps only move forward; wait for that save's handle first"
                )

    async def save(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        storage: Storage,
        keep_last: int | None,
    ) -> concurrent.futures.Future[SaveResult]:
        """Start a save to ``storage``; returns once every byte is captured, with a future
        for durability. ``keep_last`` is the retention applied there after the commit.
        Cancelled before it returns, the save is aborted: nothing of it is committed."""
        self.raise_unobserved()
        self._check_order(plan.step, storage)
        if self._pending is None:
            self._pending = asyncio.Semaphore(self.config.max_pending_saves)
        await self._pending.acquire()
        try:
            self.raise_unobserved()  # a save that failed while we waited
            self._check_order(plan.step, storage)
        except BaseException:
            self._pending.release()
            raise
        loop = asyncio.get_running_loop()
        durable: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        durable.set_running_or_notify_cancel()  # nobody may cancel it from outside
        job = _SaveJob(
            plan, order, started, storage, keep_last, loop.create_future(), durable,
            self.events.scope("save", plan.step, storage.url, plan.save_id),
        )  # fmt: skip
        self._jobs[plan.save_id] = job
        job.emit("start")
        job.task = loop.create_task(self._run(job))
        job.task.add_done_callback(lambda task: self._forget(job, task))
        try:
            await asyncio.shield(job.captured)
        except asyncio.CancelledError:
            self.abort(plan.save_id)
            raise
        return durable

    def abort(self, save_id: str) -> None:
        """The caller gave up on ``save()`` before receiving its handle: cancel that save
        unless its commit has begun (then it stands). Loop thread."""
        job = self._jobs.get(save_id)
        if job is not None and job.task is not None and not job.commit_started:
            job.task.cancel()

    def _saves_to(self, storage: Storage) -> list[_SaveJob]:
        """Saves in flight to the root of ``storage`` (compared by URL: two backends opened
        on one root are one root)."""
        return [job for job in self._jobs.values() if job.storage.url == storage.url]

    def _forget(self, job: _SaveJob, task: asyncio.Task[None]) -> None:
        """Done callback of a save's task, however it ended (cancelled before its first
        step included): free its slot and its name, and settle whatever is not settled."""
        assert self._pending is not None
        self._jobs.pop(job.plan.save_id, None)
        self._pending.release()
        if not job.captured.done():
            job.captured.cancel()
        if not job.durable.done():
            job.emit("exception", exception=asyncio.CancelledError())
            job.durable.set_exception(concurrent.futures.CancelledError(f"save of step {job.plan.step} was cancelled"))

    async def _run(self, job: _SaveJob) -> None:
        try:
            result = await self._save(job)
        except BaseException as exc:
            # Settling runs to its end even if cancelled again (close(timeout) running out):
            # the handle always resolves and the failure is always reported.
            committed = await complete_before_cancel(self._after_failure(job, exc))
            if committed is None:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            result = committed
        job.emit("end", nbytes=result.nbytes, seconds=result.durable_s)
        if not job.captured.done():
            job.captured.set_result(result.blocked_s)
        job.durable.set_result(result)

    async def _save(self, job: _SaveJob) -> SaveResult:
        """Capture, upload, commit, retention: the happy path of one save."""
        plan, storage = job.plan, job.storage
        look = asyncio.ensure_future(preflight(storage, plan.step))
        look.add_done_callback(_retrieve)
        try:
            job.session = self._spool_session(plan, storage, job.keep_last)
            try:
                crcs = await self._stage(job, look)
                decided = await look
                decided.check(storage.url)
                commit_started = time.perf_counter()
                manifest = build_manifest(plan.spec, crcs)
                job.commit_started = True
                manifest_bytes = await commit_manifest(storage, manifest, replace=decided.replaces)
            finally:  # committed or failed, the save's spool folder has served
                if job.session is not None:
                    await complete_before_cancel(job.session.finish())
        finally:
            look.cancel()
        job.stages["commit"] = time.perf_counter() - commit_started
        job.result = self._result(job, deleted=())
        job.emit("end", stage="commit", nbytes=manifest_bytes, seconds=job.stages["commit"])
        deleted = await self._retention(plan.step, storage, job.keep_last)
        job.result = dataclasses.replace(job.result, deleted_steps=tuple(deleted))
        return job.result

    def _result(self, job: _SaveJob, deleted: tuple[int, ...]) -> SaveResult:
        session = job.session
        return SaveResult(
            step=job.plan.step,
            save_id=job.plan.save_id,
            nbytes=job.plan.total_bytes,
            objects=len(job.plan.chunks),
            blocked_s=job.blocked,
            durable_s=time.perf_counter() - job.started,
            ram_high_water=self.budget.high_water,
            deleted_steps=deleted,
            spooled_chunks=0 if session is None else session.spooled,
            spool_fallback=None if session is None else session.fallback,
            stage_seconds=dict(job.stages),
            spool_high_water=None if self.spool is None else self.spool.budget.high_water,
        )

    async def _after_failure(self, job: _SaveJob, exc: BaseException) -> SaveResult | None:
        """Settle a save that raised ``exc``: its result if it committed after all, else
        None once the failure is reported and the attempt's removal is scheduled (or left
        to gc when the commit's outcome cannot be read back)."""
        plan, storage = job.plan, job.storage
        if job.result is not None:  # committed; only retention was interrupted
            return job.result
        remove = True
        if job.commit_started:
            # a refusal (another writer's manifest is there) is definite; anything else may
            # have been a request abandoned mid-way, which on an object store can still land
            interrupted = not isinstance(exc, FileExistsError)
            verdict = await whose_commit(storage, plan.step, plan.save_id, write_interrupted=interrupted)
            if verdict == "ours":
                log.info("aiosnap: step %d committed although its save reported %r", plan.step, exc)
                job.result = self._result(job, deleted=())
                return job.result
            remove = verdict == "other"
            if not remove:
                log.warning(
                    "aiosnap: the commit of step %d may or may not have landed (%r); its data is left "
                    "in place for `aiosnap gc`", plan.step, exc,
                )  # fmt: skip
        job.emit("exception", exception=exc)
        cancelled = isinstance(exc, asyncio.CancelledError)
        if not job.captured.done():  # save() itself raises it (or was cancelled): reported there
            if cancelled:
                job.captured.cancel()
            else:
                job.captured.set_exception(exc)
                job.captured.exception()  # seen by save(), or by nobody if save() was cancelled
        elif not cancelled:
            self.failures.record(exc)  # before the handle can hand it out: see FailureLedger
        if cancelled:
            job.durable.set_exception(concurrent.futures.CancelledError(f"save of step {plan.step} was cancelled"))
        else:
            job.durable.set_exception(exc)
        if remove:
            cleanup = asyncio.get_running_loop().create_task(remove_attempt(storage, plan.step, plan.save_id))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
        return None

    def _spool_session(self, plan: SavePlan, storage: Storage, keep_last: int | None) -> SpoolSession | None:
        if self.spool is None:
            return None
        pool = self._pool_for(plan)
        return SpoolSession(self.spool, plan, storage.url, self.storage.url, pool, self._bounce, keep_last)

    async def _stage(self, job: _SaveJob, look: asyncio.Future[Preflight]) -> Checksums:
        """Capture and upload concurrently; returns the crc32c of every piece. Resolves
        ``job.captured`` (save() returns) once every byte is captured and the step order
        is checked; fills ``job.stages`` and emits each stage's end event."""
        plan, session = job.plan, job.session
        pool = self._pool_for(plan)
        crcs: Checksums = {}
        workers = min(self.config.upload.concurrency, max(1, len(plan.chunks)))
        # Room for every chunk: what bounds the chunks in flight is the slab pool (RAM budget).
        queue: asyncio.Queue[StagedChunk | None] = asyncio.Queue(maxsize=len(plan.chunks) + 1)
        may_start = asyncio.Event()
        clock = _StageClock()
        landed = None if session is None else session.landed
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    group.create_task(upload_worker(queue, job.storage, crcs, may_start, landed, clock))
                capture_started = time.perf_counter()
                await capture_chunks(plan, pool, queue, self._executor, self._copier, job.order, may_start, session)
                if session is not None:
                    await session.captured()  # the journal says so before save() returns
                capture_done = time.perf_counter()
                await self._check_preflight(job, look)
                now = time.perf_counter()
                job.blocked = now - job.started
                job.stages["capture"] = capture_done - capture_started
                job.captured.set_result(job.blocked)
                may_start.set()
                job.emit("end", stage="capture", nbytes=plan.total_bytes, seconds=job.stages["capture"])
                if session is not None and session.spooled:
                    job.stages["spool"] = session.spool_seconds
                    job.emit("end", stage="spool", nbytes=session.spooled_bytes, seconds=session.spool_seconds)
                for _ in range(workers):
                    await queue.put(None)
        except BaseExceptionGroup as group_error:
            raise (leaf := first_error(group_error)) from leaf.__cause__
        finally:
            while not queue.empty():
                staged = queue.get_nowait()
                if staged is not None:
                    staged.release()
        job.stages["upload"] = clock.seconds
        job.emit("end", stage="upload", nbytes=plan.total_bytes, seconds=clock.seconds)
        return crcs

    @staticmethod
    async def _check_preflight(job: _SaveJob, look: asyncio.Future[Preflight]) -> None:
        """Refuse the step in save() itself when the look at the root is back in time;
        otherwise (a slow store, or one that failed: a background failure like any other)
        it is checked before the commit."""
        if not look.done():
            await asyncio.wait([look], timeout=PREFLIGHT_GRACE_S)
        if look.done() and look.exception() is None:
            look.result().check(job.storage.url)

    async def _retention(self, step: int, storage: Storage, keep_last: int | None) -> list[int]:
        busy = {job.plan.step for job in self._saves_to(storage)}
        try:
            return await apply_retention(storage, keep_last, step, busy)
        except Exception as exc:  # the checkpoint is committed; a failed cleanup must not undo that
            log.warning("aiosnap: retention after step %d failed: %r", step, exc)
            return []

    async def steps(self, storage: Storage) -> list[int]:
        """Committed steps, ascending."""
        return await committed_steps(storage)

    async def read(
        self, step: int | None, allow_pickle: bool, storage: Storage
    ) -> tuple[Manifest, dict[int, torch.Tensor]]:
        """The manifest of ``step`` (latest committed when None) and its verified tensors."""
        manifest = await self.manifest(step, storage)
        check_pickles(manifest, allow_pickle)
        return manifest, await fetch_entries(storage, manifest, self.config.upload.concurrency)

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
            raise TimeoutError(f"{len(pending)} save(s) did not commit within {timeout} s and were cancelled")

    async def resume(
        self, progress: ResumeProgress | None = None, storage: Storage | None = None, keep_last: int | None = None
    ) -> ResumeReport:
        """Finish the spooled saves an earlier process left behind for ``storage`` (this
        engine's own root by default), with retention ``keep_last`` (see pipeline.resume)."""
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
        """Free slabs, the spool lock and connections (after drain). Removals of failed
        attempts get :data:`CLEANUP_WAIT_S` to finish; the rest is left to ``aiosnap gc``."""
        if self._cleanups:
            _, late = await asyncio.wait(set(self._cleanups), timeout=CLEANUP_WAIT_S)
            for task in late:
                task.cancel()
            if late:
                log.warning("aiosnap: %d failed attempt(s) not removed by close(); `aiosnap gc` will", len(late))
                await asyncio.wait(late)
        if self._pool is not None:
            self._pool.trim()
        if self.spool is not None:
            self.spool.close()
        self._executor.shutdown(wait=True)
        await self.storage.close()
