"""Local-disk spool: chunks that the RAM budget cannot hold (or every chunk, in ``always``
mode) are written to local disk during capture, uploaded from there, and deleted once
they have landed.

Layout of ``spool.dir``::

    LOCK                         flock()ed by the one checkpointer using this spool
    <save id>/<chunk>.bin        captured chunk bytes, fsynced
    <save id>/journal.jsonl      append-only record of the save (see pipeline.journal)

The journal is started by the first spill; a spool file is deleted only after a journal
record saying its chunk landed is on disk. A save is resumable after a crash when its
journal says captured and every chunk has landed or is on the spool disk. Coroutines run
on the loop thread; file I/O runs in worker threads.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from .. import durable
from ..aio import complete_before_cancel
from ..budget import ByteBudget
from ..checksums import crc32c_of
from ..config import SpoolConfig
from ..errors import SpoolBusyError
from ..format.journal import JOURNAL, JournalWriter
from ..tensorio import bytes_view
from .capture import BufferPool, StagedChunk
from .plan import Chunk, SavePlan

__all__ = ["JOURNAL", "Bounce", "Spool", "SpoolSession"]

log = logging.getLogger("aiosnap")
LOCK = "LOCK"


class Spool:
    """One spool directory, locked for this process, with its disk budget."""

    def __init__(self, root: Path, budget: ByteBudget, mode: str, lock_fd: int) -> None:
        self.root = root
        self.budget = budget
        self.mode = mode
        self.active: set[str] = set()
        """Save ids with a session in this process: never leftovers (loop thread)."""
        self._lock_fd: int | None = lock_fd

    @classmethod
    def open(cls, config: SpoolConfig, min_bytes: int) -> Spool | None:
        """Lock and size the spool (caller's thread, at checkpointer start). None when the
        spool is off, or unusable (unwritable, too little space): saves then wait for RAM."""
        mode = config.effective_mode
        if mode == "off" or not config.dir:
            return None
        root = Path(config.dir).expanduser().absolute()
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("aiosnap: spool.dir %s is not usable (%s): spooling is off, saves wait for RAM", root, exc)
            return None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise SpoolBusyError(f"spool.dir {root} is in use by another checkpointer (its lock is held)") from None
        free = shutil.disk_usage(root).free
        if isinstance(config.budget, str):
            budget = int(free * float(config.budget[:-1]) / 100)
        else:
            budget = min(config.budget, free)
            if budget < config.budget:
                log.warning(
                    "aiosnap: spool.budget %d exceeds the free space of %s; using %d", config.budget, root, free
                )
        if budget < min_bytes:
            log.warning(
                "aiosnap: spool budget %d bytes cannot hold one chunk of %d: spooling is off", budget, min_bytes
            )
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)
            return None
        return cls(root, ByteBudget(budget, "spool.budget"), mode, lock_fd)

    def save_dir(self, save_id: str) -> Path:
        return self.root / save_id

    async def spill(
        self, save_id: str, index: int, data: memoryview, ranges: list[tuple[int, int]]
    ) -> tuple[str, int, list[int]]:
        """Write one chunk durably; returns its path, its crc32c and those of its ranges.
        OSError (ENOSPC, EACCES) is raised as is, the partial file removed."""
        directory = self.save_dir(save_id)
        path = directory / f"{index}.bin"

        def write() -> tuple[int, list[int]]:
            directory.mkdir(exist_ok=True)
            durable.write_file(path, data)
            return crc32c_of(data), [crc32c_of(data[offset : offset + nbytes]) for offset, nbytes in ranges]

        try:
            # run to the end even if cancelled: the thread reads a slab that is reused
            # afterwards, and a file it finished later would outlive the cleanup
            crc, pieces = await complete_before_cancel(asyncio.to_thread(write))
        except BaseException:
            await asyncio.to_thread(path.unlink, True)
            raise
        return str(path), crc, pieces

    async def discard(self, save_id: str) -> None:
        await complete_before_cancel(asyncio.to_thread(shutil.rmtree, self.save_dir(save_id), True))

    def leftovers(self, live: set[str]) -> list[str]:
        """Save folders left by an earlier process (not those of ``live`` save ids, nor of
        a session of this process). Any thread: reads the directory only."""
        busy = self.active | live
        return sorted(e.name for e in self.root.iterdir() if e.is_dir() and e.name not in busy)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


class Bounce:
    """The one staging slab kept aside (inside the RAM budget) to spill chunks through when
    every other slab is taken. Loop thread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.lock = asyncio.Lock()
        self._buffer: torch.Tensor | None = None

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        return self._buffer


class _DiskLease:
    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self._budget: ByteBudget | None = budget
        self._nbytes = nbytes

    def __call__(self) -> None:
        if self._budget is not None:
            self._budget.release(self._nbytes)
            self._budget = None


class SpoolSession:
    """One save's use of the spool: spilling chunks during capture, the journal, cleanup.
    Loop thread."""

    def __init__(
        self,
        spool: Spool,
        plan: SavePlan,
        storage_url: str,
        owner_url: str,
        pool: BufferPool,
        bounce: Bounce | None,
        keep_last: int | None,
    ) -> None:
        self.spool = spool
        self.plan = plan
        self.storage_url = storage_url
        self.owner_url = owner_url
        self.keep_last = keep_last
        self.pool = pool
        self.bounce = bounce
        self.fallback: str | None = None
        self.spooled = 0
        self.spooled_bytes = 0
        self.spool_seconds = 0.0
        """Time spent copying into spool buffers and writing spool files."""
        self._landed: dict[int, list[int]] = {}
        self._journal: JournalWriter | None = None
        self._journal_ok = True
        self._journal_lock = asyncio.Lock()
        self._kept: list[Callable[[], None]] = []  # disk leases of files kept for a broken journal
        spool.active.add(plan.save_id)

    def wants(self, pool: BufferPool) -> bool:
        """Spill this chunk? Always in ``always`` mode; in ``overflow`` when RAM is short."""
        if self.fallback is not None:
            return False
        return self.spool.mode == "always" or (self.bounce is not None and pool.would_wait())

    def disk_would_wait(self, nbytes: int) -> bool:
        """True when the disk budget cannot take ``nbytes`` now."""
        return self.spool.budget.used + nbytes > self.spool.budget.capacity

    async def capture(self, chunk: Chunk, copy: Callable[[torch.Tensor], Awaitable[None]]) -> StagedChunk | None:
        """Copy ``chunk`` into a buffer, write it to the spool and journal it. None: not
        spilled (no disk budget right now, or the disk failed: then this save falls back to
        RAM)."""
        nbytes = chunk.nbytes
        budget = self.spool.budget
        if self.spool.mode == "always":
            await budget.acquire(nbytes)
        elif not budget.try_acquire(nbytes):
            return None
        ranges = [(p.dst_offset, p.nbytes) for p in chunk.pieces]
        began = time.perf_counter()
        try:
            path, crc, pieces = await self._spill(chunk, copy, ranges)
            await self._record({"kind": "spooled", "chunk": chunk.index, "crc": crc, "pieces": pieces})
        except OSError as exc:
            budget.release(nbytes)
            await asyncio.to_thread(Path(self.spool.save_dir(self.plan.save_id), f"{chunk.index}.bin").unlink, True)
            self.fallback = f"{type(exc).__name__}: {exc}"
            log.warning(
                "aiosnap: spooling step %d to %s failed (%s); this save waits for RAM instead",
                self.plan.step, self.spool.root, self.fallback,
            )  # fmt: skip
            return None
        except BaseException:
            budget.release(nbytes)
            raise
        self.spooled += 1
        self.spooled_bytes += nbytes
        self.spool_seconds += time.perf_counter() - began
        return StagedChunk(
            index=chunk.index,
            object_name=chunk.object_name,
            data=memoryview(b""),
            ranges=ranges,
            release=_DiskLease(budget, nbytes),
            spool_path=path,
            chunk_crc=crc,
            piece_crcs=pieces,
        )

    async def _spill(
        self, chunk: Chunk, copy: Callable[[torch.Tensor], Awaitable[None]], ranges: list[tuple[int, int]]
    ) -> tuple[str, int, list[int]]:
        """Copy the chunk into a RAM buffer (a slab, or the bounce slab) and write it out."""
        if self.spool.mode == "always":
            slab = await self.pool.acquire()
            buffer = slab

            def give_back() -> None:
                self.pool.release(slab)
        else:
            assert self.bounce is not None
            await self.bounce.lock.acquire()
            buffer = self.bounce.buffer
            give_back = self.bounce.lock.release
        try:
            await copy(buffer)
            return await self.spool.spill(
                self.plan.save_id, chunk.index, bytes_view(buffer)[: chunk.nbytes], ranges
            )  # fmt: skip
        finally:
            give_back()

    async def _record(self, record: dict[str, object]) -> None:
        """Append a record, starting the journal (with what has landed so far) if needed.
        OSError when the journal cannot be written."""
        async with self._journal_lock:
            if not self._journal_ok:
                raise OSError("the spool journal of this save could not be written earlier")
            try:
                if self._journal is None:
                    self._journal = JournalWriter(self.spool.save_dir(self.plan.save_id) / JOURNAL)
                    landed = [{"kind": "landed", "chunk": i, "pieces": p} for i, p in self._landed.items()]
                    await self._journal.append(self._begin(), *landed, record)
                else:
                    await self._journal.append(record)
            except OSError:
                self._journal_ok = False
                raise

    def _begin(self) -> dict[str, object]:
        return {
            "kind": "begin",
            "format": 3,
            "save_id": self.plan.save_id,
            "step": self.plan.step,
            "storage_url": self.storage_url,
            "owner_url": self.owner_url,
            "keep_last": self.keep_last,
            "spec": self.plan.spec.to_document(),
        }

    async def captured(self) -> None:
        """Capture is complete: if anything went to the spool, journal it (before save()
        returns, so that a crash from here on loses nothing that is on disk)."""
        if self._journal is None:
            return
        try:
            await self._record({"kind": "captured"})
        except OSError as exc:
            self._broken(exc)

    def _broken(self, exc: OSError) -> None:
        self.fallback = self.fallback or f"{type(exc).__name__}: {exc}"
        log.warning(
            "aiosnap: cannot write the spool journal of step %d (%s): the save goes on, "
            "but would not survive a crash", self.plan.step, exc,
        )  # fmt: skip

    async def landed(self, staged: StagedChunk, checksums: list[int]) -> None:
        """A chunk reached storage: journal it, then drop its spool file (only once the
        journal says it landed; a file whose record could not be written stays until the
        save ends, with its disk budget)."""
        self._landed[staged.index] = checksums
        durable = False
        if self._journal is not None and self._journal_ok:
            try:
                await self._record({"kind": "landed", "chunk": staged.index, "pieces": checksums})
                durable = True
            except OSError as exc:
                self._broken(exc)
        if staged.spool_path is None:
            return
        if durable:
            await complete_before_cancel(asyncio.to_thread(Path(staged.spool_path).unlink, True))
        else:
            self._kept.append(staged.release)
            staged.release = _no_op

    async def finish(self) -> None:
        """The save committed or failed: its spool folder goes."""
        try:
            await self.spool.discard(self.plan.save_id)  # also the empty folder of a save cancelled mid-spill
        finally:
            for release in self._kept:
                release()
            self._kept.clear()
            self.spool.active.discard(self.plan.save_id)


def _no_op() -> None:
    """A release that has been taken over by the session."""
