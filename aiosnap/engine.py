"""The engine: every save and load as it runs on the background loop thread.

The public :class:`~aiosnap.Checkpointer` and :class:`~aiosnap.SyncCheckpointer` only plan
on the caller's thread and hand coroutines of this class to the loop; all state below is
touched by the loop thread alone.

A save: wait for a pending-save slot (backpressure) -> capture every chunk into RAM slabs
(``save()`` returns here) -> upload workers write and checksum chunks, releasing slabs ->
manifest (commit) -> retention. Any failure cancels the sibling stages, removes the
attempt's objects, and is kept to be re-raised with its original type.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import torch

from .budget import ByteBudget
from .config import Config
from .errors import first_error
from .events import EventBus
from .manifest import Checksums, Manifest, build_manifest
from .pipeline.capture import BufferPool, Copier, CudaOrder, StagedChunk, capture_chunks
from .pipeline.commit import (
    apply_retention,
    commit_manifest,
    committed_steps,
    manifest_of,
    remove_attempt,
    remove_everything,
)
from .pipeline.fetch import fetch_entries
from .pipeline.resume import Progress as ResumeProgress
from .pipeline.resume import ResumeReport, resume_spooled
from .pipeline.spool import Bounce, Spool, SpoolSession
from .pipeline.upload import upload_worker
from .plan import ALIGN, SavePlan
from .restore import check_pickles
from .storage.base import Storage, storage_from_url

__all__ = ["Engine", "ResumeReport", "SaveResult", "slab_bytes_for"]

log = logging.getLogger("aiosnap")


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
        self._tasks: dict[asyncio.Task[None], Storage] = {}  # saves running, and where to
        self._in_flight: dict[str, tuple[Storage, int]] = {}  # save id -> where, step
        self.unreported: BaseException | None = None  # raised by the next save(), then cleared
        self.last_failure: BaseException | None = None  # raised by close() unless a later save committed

    def _pool_for(self, plan: SavePlan) -> BufferPool:
        if self._pool is None:
            cuda = any(e.tensor.device.type == "cuda" for e in plan.entries)
            self._pool = BufferPool(self.budget, self.slab_bytes, pin_memory=cuda and torch.cuda.is_available())
        return self._pool

    def raise_unreported(self) -> None:
        """Re-raise (once) a background failure no save() has reported yet."""
        failure, self.unreported = self.unreported, None
        if failure is not None:
            raise failure

    async def save(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        storage: Storage,
        keep_last: int | None,
    ) -> concurrent.futures.Future[SaveResult]:
        """Start a save to ``storage``; returns once every byte is captured, with a future
        for durability. ``keep_last`` is the retention applied there after the commit."""
        self.raise_unreported()
        if self._pending is None:
            self._pending = asyncio.Semaphore(self.config.max_pending_saves)
        await self._pending.acquire()
        try:
            self.raise_unreported()  # a save that failed while we waited
        except BaseException:
            self._pending.release()
            raise
        durable: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        durable.set_running_or_notify_cancel()  # nobody may cancel it from outside
        captured = asyncio.get_running_loop().create_future()
        self._in_flight[plan.save_id] = (storage, plan.step)
        self.events.scope("save", plan.step, storage.url, plan.save_id)("start")
        run = self._run(plan, order, started, captured, durable, storage, keep_last)
        task = asyncio.get_running_loop().create_task(run)
        self._tasks[task] = storage
        task.add_done_callback(self._tasks.pop)
        await asyncio.shield(captured)
        return durable

    def _saves_to(self, storage: Storage) -> set[str]:
        """Save ids in flight to the root of ``storage`` (compared by URL: two backends
        opened on one root are one root)."""
        return {save_id for save_id, (where, _) in self._in_flight.items() if where.url == storage.url}

    async def _run(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        captured: asyncio.Future[float],
        durable: concurrent.futures.Future[SaveResult],
        storage: Storage,
        keep_last: int | None,
    ) -> None:
        assert self._pending is not None
        committed = False
        emit = self.events.scope("save", plan.step, storage.url, plan.save_id)
        try:
            session = self._spool_session(plan, storage, keep_last)
            stages: dict[str, float] = {}
            try:
                blocked, crcs = await self._stage(plan, order, started, captured, session, storage, stages)
                commit_started = time.perf_counter()
                manifest, manifest_bytes = await self._commit(plan, crcs, storage)
                committed = True
                stages["commit"] = time.perf_counter() - commit_started
                emit("end", stage="commit", nbytes=manifest_bytes, seconds=stages["commit"])
            finally:  # committed or failed, the save's spool folder has served
                if session is not None:
                    await asyncio.shield(session.finish())
            deleted = await self._retention(manifest.step, storage, keep_last)
            result = SaveResult(
                step=plan.step,
                save_id=plan.save_id,
                nbytes=plan.total_bytes,
                objects=len(plan.chunks),
                blocked_s=blocked,
                durable_s=time.perf_counter() - started,
                ram_high_water=self.budget.high_water,
                deleted_steps=tuple(deleted),
                spooled_chunks=0 if session is None else session.spooled,
                spool_fallback=None if session is None else session.fallback,
                stage_seconds=stages,
                spool_high_water=None if self.spool is None else self.spool.budget.high_water,
            )
            self.last_failure = None
            emit("end", nbytes=result.nbytes, seconds=result.durable_s)
            durable.set_result(result)
        except BaseException as exc:
            emit("exception", exception=exc)
            if not committed:  # a committed step's data is never removed here
                await asyncio.shield(remove_attempt(storage, plan.step, plan.save_id))
            if not isinstance(exc, asyncio.CancelledError):
                self.unreported = self.last_failure = exc
                durable.set_exception(exc)
            else:
                durable.set_exception(concurrent.futures.CancelledError(f"save of step {plan.step} was cancelled"))
                raise
        finally:
            if not captured.done():
                captured.set_result(time.perf_counter() - started)
            self._in_flight.pop(plan.save_id, None)
            self._pending.release()

    def _spool_session(self, plan: SavePlan, storage: Storage, keep_last: int | None) -> SpoolSession | None:
        if self.spool is None:
            return None
        return SpoolSession(self.spool, plan, storage.url, self._pool_for(plan), self._bounce, keep_last)

    async def _stage(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        captured: asyncio.Future[float],
        session: SpoolSession | None,
        storage: Storage,
        stages: dict[str, float],
    ) -> tuple[float, Checksums]:
        """Capture and upload concurrently; returns the seconds save() was blocked and the
        crc32c of every piece. Fills ``stages`` and emits each stage's end event."""
        pool = self._pool_for(plan)
        crcs: Checksums = {}
        workers = min(self.config.upload.concurrency, max(1, len(plan.chunks)))
        # Room for every chunk: what bounds the chunks in flight is the slab pool (RAM budget).
        queue: asyncio.Queue[StagedChunk | None] = asyncio.Queue(maxsize=len(plan.chunks) + 1)
        may_start = asyncio.Event()
        clock = _StageClock()
        landed = None if session is None else session.landed
        emit = self.events.scope("save", plan.step, storage.url, plan.save_id)
        blocked = 0.0
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    group.create_task(upload_worker(queue, storage, crcs, may_start, landed, clock))
                capture_started = time.perf_counter()
                await capture_chunks(plan, pool, queue, self._executor, self._copier, order, may_start, session)
                if session is not None:
                    await session.captured()  # the journal is on disk before save() returns
                now = time.perf_counter()
                blocked = now - started
                stages["capture"] = now - capture_started
                captured.set_result(blocked)
                emit("end", stage="capture", nbytes=plan.total_bytes, seconds=stages["capture"])
                if session is not None and session.spooled:
                    stages["spool"] = session.spool_seconds
                    emit("end", stage="spool", nbytes=session.spooled_bytes, seconds=session.spool_seconds)
                for _ in range(workers):
                    await queue.put(None)
        except BaseExceptionGroup as group_error:
            raise (leaf := first_error(group_error)) from leaf.__cause__
        finally:
            while not queue.empty():
                staged = queue.get_nowait()
                if staged is not None:
                    staged.release()
        stages["upload"] = clock.seconds
        emit("end", stage="upload", nbytes=plan.total_bytes, seconds=clock.seconds)
        return blocked, crcs

    async def _commit(self, plan: SavePlan, crcs: Checksums, storage: Storage) -> tuple[Manifest, int]:
        """Write the manifest; returns it and its size in bytes."""
        manifest = build_manifest(plan).with_checksums(crcs)
        others = self._saves_to(storage) - {plan.save_id}
        return manifest, await commit_manifest(storage, manifest, others)

    async def _retention(self, step: int, storage: Storage, keep_last: int | None) -> list[int]:
        busy = {s for where, s in self._in_flight.values() if where.url == storage.url}
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
        """Wait for the saves to ``storage``, then delete everything under it."""
        await self.drain(None, storage)
        return await remove_everything(storage)

    async def drain(self, timeout: float | None, storage: Storage | None = None) -> None:
        """Wait for saves in flight (to ``storage`` only, when given); after ``timeout``
        seconds cancel the rest."""
        tasks = {task for task, where in self._tasks.items() if storage is None or where.url == storage.url}
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            raise TimeoutError(f"{len(pending)} save(s) did not commit within {timeout} s and were cancelled")

    async def resume(self, progress: ResumeProgress | None = None) -> ResumeReport:
        """Finish the spooled saves an earlier process left behind (see pipeline.resume)."""
        if self.spool is None:
            return ResumeReport()
        return await resume_spooled(
            self.spool,
            self.storage,
            concurrency=self.config.upload.concurrency,
            keep_last=self.config.retention.keep_last,
            storage_for=lambda url: storage_from_url(url, self.config),
            progress=progress,
        )

    async def shutdown(self) -> None:
        """Free slabs, the spool lock and connections (after drain)."""
        if self._pool is not None:
            self._pool.trim()
        if self.spool is not None:
            self.spool.close()
        self._executor.shutdown(wait=True)
        await self.storage.close()
