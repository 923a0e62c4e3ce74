"""Local-disk spool: chunks that the RAM budget cannot hold (or every chunk, in ``always``
mode) are written to local disk during capture, uploaded from there, and deleted once
they have landed.

Layout of ``spool.dir``::

    LOCK                         flock()ed by the one checkpointer using this spool
    <save id>/<chunk>.bin        captured chunk bytes, fsynced
    <save id>/journal.json       written once capture is complete, updated as chunks land

The journal carries the manifest to commit (crc32c still 0), each chunk's object name,
size, whole-chunk crc32c and state (spooled / landed), and the crc32c of every piece known
so far. A save is resumable after a crash when its journal says captured and every chunk
has landed or is on the spool disk. Coroutines run on the loop thread; file I/O runs in
the default executor.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import crc32c
import torch

from ..budget import ByteBudget
from ..config import SpoolConfig
from ..errors import SpoolBusyError
from ..manifest import Checksums, build_manifest
from ..plan import Chunk, SavePlan
from ..storage.base import complete_before_cancel
from ..tensorio import bytes_view
from .capture import BufferPool, StagedChunk

__all__ = ["JOURNAL", "Bounce", "Spool", "SpoolSession", "file_crc32c"]

log = logging.getLogger("aiosnap")
JOURNAL = "journal.json"
LOCK = "LOCK"


def file_crc32c(path: str | Path) -> int:
    """crc32c of a whole file, read in 8 MiB blocks (runs on the calling thread)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            crc = crc32c.crc32c(block, crc)
    return int(crc)


def _write_durably(path: Path, data: memoryview | bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    _write_durably(tmp, data)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    """One spool directory, locked for this process, with its disk budget."""

    def __init__(self, root: Path, budget: ByteBudget, mode: str, lock_fd: int) -> None:
        self.root = root
        self.budget = budget
        self.mode = mode
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
            _write_durably(path, data)
            pieces = [int(crc32c.crc32c(data[offset : offset + nbytes])) for offset, nbytes in ranges]
            return int(crc32c.crc32c(data)), pieces

        try:
            # run to the end even if cancelled: the thread reads a slab that is reused
            # afterwards, and a file it finished later would outlive the cleanup
            crc, pieces = await complete_before_cancel(asyncio.to_thread(write))
        except BaseException:
            await asyncio.to_thread(path.unlink, True)
            raise
        return str(path), crc, pieces

    async def write_journal(self, save_id: str, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode("utf-8")
        # completed even if cancelled, so that no journal lands after the save's cleanup
        await complete_before_cancel(asyncio.to_thread(_write_atomically, self.save_dir(save_id) / JOURNAL, data))

    async def discard(self, save_id: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self.save_dir(save_id), True)

    def leftovers(self) -> list[tuple[str, dict[str, Any] | None]]:
        """Save folders left by an earlier process, with their journals (None when missing
        or unreadable). Caller's thread."""
        found: list[tuple[str, dict[str, Any] | None]] = []
        for entry in sorted(self.root.iterdir()):
            if not entry.is_dir():
                continue
            try:
                doc = json.loads((entry / JOURNAL).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                doc = None
            found.append((entry.name, doc if isinstance(doc, dict) else None))
        return found

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
        pool: BufferPool,
        bounce: Bounce | None,
        keep_last: int | None,
    ) -> None:
        self.spool = spool
        self.plan = plan
        self.storage_url = storage_url
        self.keep_last = keep_last
        self.pool = pool
        self.bounce = bounce
        self.fallback: str | None = None
        self.spooled = 0
        self.spooled_bytes = 0
        self.spool_seconds = 0.0
        """Time spent copying into spool buffers and writing spool files."""
        self._state: dict[int, str] = {}
        self._chunk_crcs: dict[int, int] = {}
        self._crcs: Checksums = {}
        self._skeleton = build_manifest(plan).model_dump(mode="json")
        self._journal_written = False
        self._journal_lock = asyncio.Lock()

    def wants(self, pool: BufferPool) -> bool:
        """Spill this chunk? Always in ``always`` mode; in ``overflow`` when RAM is short."""
        if self.fallback is not None:
            return False
        return self.spool.mode == "always" or (self.bounce is not None and pool.would_wait())

    def disk_would_wait(self, nbytes: int) -> bool:
        """True when the disk budget cannot take ``nbytes`` now."""
        return self.spool.budget.used + nbytes > self.spool.budget.capacity

    async def capture(self, chunk: Chunk, copy: Callable[[torch.Tensor], Awaitable[None]]) -> StagedChunk | None:
        """Copy ``chunk`` into a buffer and write it to the spool. None: not spilled (no disk
        budget right now, or the disk failed: then this save falls back to RAM)."""
        nbytes = chunk.nbytes
        if self.spool.mode == "always":
            await self.spool.budget.acquire(nbytes)
            slab = await self.pool.acquire()
            buffer = slab

            def give_back() -> None:
                self.pool.release(slab)
        else:
            assert self.bounce is not None
            if not self.spool.budget.try_acquire(nbytes):
                return None
            await self.bounce.lock.acquire()
            buffer = self.bounce.buffer
            give_back = self.bounce.lock.release
        ranges = [(p.dst_offset, p.nbytes) for p in chunk.pieces]
        began = time.perf_counter()
        try:
            await copy(buffer)
            path, crc, pieces = await self.spool.spill(
                self.plan.save_id, chunk.index, bytes_view(buffer)[:nbytes], ranges
            )
        except OSError as exc:
            self.spool.budget.release(nbytes)
            self.fallback = f"{type(exc).__name__}: {exc}"
            log.warning(
                "aiosnap: spooling step %d to %s failed (%s); this save waits for RAM instead",
                self.plan.step, self.spool.root, self.fallback,
            )  # fmt: skip
            return None
        except BaseException:
            self.spool.budget.release(nbytes)
            raise
        finally:
            give_back()
        self.spooled += 1
        self.spooled_bytes += nbytes
        self.spool_seconds += time.perf_counter() - began
        self._state[chunk.index] = "spooled"
        self._chunk_crcs[chunk.index] = crc
        for (offset, _), piece_crc in zip(ranges, pieces, strict=True):
            self._crcs[(chunk.object_name, offset)] = piece_crc
        return StagedChunk(
            index=chunk.index,
            object_name=chunk.object_name,
            data=memoryview(b""),
            ranges=ranges,
            release=_DiskLease(self.spool.budget, nbytes),
            spool_path=path,
            chunk_crc=crc,
            piece_crcs=pieces,
        )

    def _journal(self) -> dict[str, Any]:
        return {
            "format": 1,
            "save_id": self.plan.save_id,
            "step": self.plan.step,
            "storage_url": self.storage_url,
            "keep_last": self.keep_last,
            "captured": True,
            "manifest": self._skeleton,
            "chunks": [
                {
                    "object": c.object_name,
                    "nbytes": c.nbytes,
                    "state": self._state.get(c.index, "ram"),
                    "crc": self._chunk_crcs.get(c.index),
                }
                for c in self.plan.chunks
            ],
            "crcs": [[obj, offset, crc] for (obj, offset), crc in self._crcs.items()],
        }

    async def captured(self) -> None:
        """Capture is complete: if anything went to the spool, write the journal (before
        save() returns, so that a crash from here on loses nothing that is on disk)."""
        if self.spooled:
            self._journal_written = await self._write_journal()

    async def _write_journal(self) -> bool:
        """Rewrite the journal; on a disk error the save goes on, only no longer resumable."""
        async with self._journal_lock:
            try:
                await self.spool.write_journal(self.plan.save_id, self._journal())
            except OSError as exc:
                self.fallback = self.fallback or f"{type(exc).__name__}: {exc}"
                log.warning(
                    "aiosnap: cannot write the spool journal of step %d (%s): the save goes on, "
                    "but would not survive a crash", self.plan.step, exc,
                )  # fmt: skip
                return False
        return True

    async def landed(self, staged: StagedChunk, checksums: list[int]) -> None:
        """A chunk reached storage: record it (journal first), then drop its spool file."""
        self._state[staged.index] = "landed"
        for (offset, _), crc in zip(staged.ranges, checksums, strict=True):
            self._crcs[(staged.object_name, offset)] = crc
        if self._journal_written:
            self._journal_written = await self._write_journal()
        if staged.spool_path is not None:
            await asyncio.to_thread(Path(staged.spool_path).unlink, True)

    async def finish(self) -> None:
        """The save committed or failed: its spool folder goes."""
        if self.spooled or self.fallback:
            await self.spool.discard(self.plan.save_id)
