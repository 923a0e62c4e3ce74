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
from dataclasses import dataclass

import torch

from .budget import ByteBudget
from .config import Config
from .errors import CheckpointNotFoundError, first_error
from .manifest import Checksums, Manifest, build_manifest
from .pipeline.capture import BufferPool, Copier, CudaOrder, StagedChunk, capture_chunks
from .pipeline.commit import apply_retention, commit_manifest, committed_steps, read_manifest, remove_attempt
from .pipeline.fetch import fetch_entries
from .pipeline.resume import ResumeReport, resume_spooled
from .pipeline.spool import Bounce, Spool, SpoolSession
from .pipeline.upload import upload_worker
from .plan import ALIGN, SavePlan
from .restore import check_pickles
from .storage.base import Storage

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


class Engine:
    """Owns storage, the RAM budget and its slabs, and the saves in flight. Loop thread only."""

    def __init__(self, config: Config, storage: Storage, ram_budget: int, spool: Spool | None = None) -> None:
        self.config = config
        self.storage = storage
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
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, int] = {}  # save id -> step
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
        self, plan: SavePlan, order: CudaOrder | None, started: float
    ) -> concurrent.futures.Future[SaveResult]:
        """Start a save; returns once every byte is captured, with a future for durability."""
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
        self._in_flight[plan.save_id] = plan.step
        task = asyncio.get_running_loop().create_task(self._run(plan, order, started, captured, durable))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(captured)
        return durable

    async def _run(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        captured: asyncio.Future[float],
        durable: concurrent.futures.Future[SaveResult],
    ) -> None:
        assert self._pending is not None
        committed = False
        try:
            session = self._spool_session(plan)
            try:
                blocked, crcs = await self._stage(plan, order, started, captured, session)
                manifest = await self._commit(plan, crcs)
                committed = True
            finally:  # committed or failed, the save's spool folder has served
                if session is not None:
                    await asyncio.shield(session.finish())
            deleted = await self._retention(manifest.step)
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
            )
            self.last_failure = None
            durable.set_result(result)
        except BaseException as exc:
            if not committed:  # a committed step's data is never removed here
                await asyncio.shield(remove_attempt(self.storage, plan.step, plan.save_id))
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

    def _spool_session(self, plan: SavePlan) -> SpoolSession | None:
        if self.spool is None:
            return None
        return SpoolSession(self.spool, plan, self.storage.url, self._pool_for(plan), self._bounce)

    async def _stage(
        self,
        plan: SavePlan,
        order: CudaOrder | None,
        started: float,
        captured: asyncio.Future[float],
        session: SpoolSession | None,
    ) -> tuple[float, Checksums]:
        """Capture and upload concurrently; returns the seconds save() was blocked and the
        crc32c of every piece."""
        pool = self._pool_for(plan)
        crcs: Checksums = {}
        workers = min(self.config.upload.concurrency, max(1, len(plan.chunks)))
        # Room for every chunk: what bounds the chunks in flight is the slab pool (RAM budget).
        queue: asyncio.Queue[StagedChunk | None] = asyncio.Queue(maxsize=len(plan.chunks) + 1)
        may_start = asyncio.Event()
        blocked = 0.0
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    landed = None if session is None else session.landed
                    group.create_task(upload_worker(queue, self.storage, crcs, may_start, landed))
                await capture_chunks(plan, pool, queue, self._executor, self._copier, order, may_start, session)
                if session is not None:
                    await session.captured()  # the journal is on disk before save() returns
                blocked = time.perf_counter() - started
                captured.set_result(blocked)
                for _ in range(workers):
                    await queue.put(None)
        except BaseExceptionGroup as group_error:
            raise (leaf := first_error(group_error)) from leaf.__cause__
        finally:
            while not queue.empty():
                staged = queue.get_nowait()
                if staged is not None:
                    staged.release()
        return blocked, crcs

    async def _commit(self, plan: SavePlan, crcs: Checksums) -> Manifest:
        manifest = build_manifest(plan).with_checksums(crcs)
        others = {sid for sid, step in self._in_flight.items() if sid != plan.save_id}
        await commit_manifest(self.storage, manifest, others)
        return manifest

    async def _retention(self, step: int) -> list[int]:
        try:
            return await apply_retention(
                self.storage, self.config.retention.keep_last, step, set(self._in_flight.values())
            )
        except Exception as exc:  # the checkpoint is committed; a failed cleanup must not undo that
            log.warning("aiosnap: retention after step %d failed: %r", step, exc)
            return []

    async def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return await committed_steps(self.storage)

    async def read(self, step: int | None, allow_pickle: bool) -> tuple[Manifest, dict[int, torch.Tensor]]:
        """The manifest of ``step`` (latest committed when None) and its verified tensors."""
        manifest = await self.manifest(step)
        check_pickles(manifest, allow_pickle)
        return manifest, await fetch_entries(self.storage, manifest, self.config.upload.concurrency)

    async def manifest(self, step: int | None) -> Manifest:
        """The manifest of ``step`` (latest committed when None), without reading data."""
        if step is None:
            steps = await committed_steps(self.storage)
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.storage.url}")
            step = steps[-1]
        return await read_manifest(self.storage, step)

    async def drain(self, timeout: float | None) -> None:
        """Wait for saves in flight; after ``timeout`` seconds cancel the rest."""
        tasks = set(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            raise TimeoutError(f"{len(pending)} save(s) did not commit within {timeout} s and were cancelled")

    async def resume(self) -> ResumeReport:
        """Finish the spooled saves an earlier process left behind (see pipeline.resume)."""
        if self.spool is None:
            return ResumeReport()
        return await resume_spooled(
            self.spool,
            self.storage,
            concurrency=self.config.upload.concurrency,
            keep_last=self.config.retention.keep_last,
        )

    async def shutdown(self) -> None:
        """Free slabs, the spool lock and connections (after drain)."""
        if self._pool is not None:
            self._pool.trim()
        if self.spool is not None:
            self.spool.close()
        self._executor.shutdown(wait=True)
        await self.storage.close()
